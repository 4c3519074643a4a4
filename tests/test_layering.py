"""Architecture rules that keep the seams: imports run downward only; the engine core is pure Python."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "infertune"

# docs/ARCHITECTURE.md's layering, bottom (1) to top (7) (test_the_architecture_page_states_these_layers keeps them equal).
RANKS = {
    "config": 1,
    "sampling_params": 1,
    "kv_compression": 1,
    "scheduler_output": 1,
    "stored_quant": 1,
    "kernels": 1,
    "backends": 1,
    "quant": 2,
    "layers": 2,
    "models": 3,
    "runner": 4,
    "kv_transfer": 4,
    "executor": 5,
    "engine": 6,
    "llm": 7,
    "async_llm": 7,
    "engine_args": 7,
    "engine_flags": 7,
    "cli": 7,
    "serve": 7,
    "router": 7,
    "bench": 7,
    "profile": 7,
    "plan": 7,
    "tune": 7,
    "distill": 7,
    "assets": 7,
    "evaluate": 7,
    "tools": 7,
    "plotting": 7,
    "files": 7,
    "__main__": 7,
}


def test_the_architecture_page_states_these_layers():
    """docs/ARCHITECTURE.md's folder table names every top-level module and package with the layer used here."""
    import re

    page = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
    stated = {}
    for row in re.findall(r"^\| (.+?) \| (\d) \| .+\|$", page, flags=re.M):
        for name in re.findall(r"`([a-z_]+)(?:/|\.py)`", row[0]):
            stated[name] = int(row[1])
    assert stated == {k: v for k, v in RANKS.items() if k != "__main__"}
    present = {
        p.stem if p.is_file() else p.name
        for p in PKG.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and p.name not in ("__pycache__",))) and p.name != "__init__.py"
    }
    assert present - {"__main__"} == set(stated), "a module or package the page does not place"


def _top_level_imports(tree: ast.Module) -> list[str]:
    """infertune modules a file imports, those under `if TYPE_CHECKING:` too: a type hint that names an upper layer
    is a dependency on it all the same (the runner and executors read only the plain-data SchedulerOutput)."""
    names: list[str] = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("infertune."):
                names.append(node.module)
            elif isinstance(node, ast.Import):
                names.extend(a.name for a in node.names if a.name.startswith("infertune."))
            for child in ("body", "orelse", "finalbody", "handlers"):
                if isinstance(getattr(node, child, None), list):
                    visit(getattr(node, child))

    visit(tree.body)
    return names


def test_imports_run_downward_only():
    violations = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts == ("__init__.py",):
            continue  # the package facade re-exports from every layer
        own = RANKS[rel.parts[0].removesuffix(".py")]
        for module in _top_level_imports(ast.parse(path.read_text())):
            other = RANKS[module.split(".")[1]]
            if other > own:
                violations.append(f"{rel} (layer {own}) imports {module} (layer {other})")
    assert not violations, "\n".join(violations)


def test_engine_core_imports_no_torch():
    code = (
        "import sys\n"
        "import infertune.engine.sequence, infertune.engine.block_manager, infertune.engine.scheduler\n"
        "import infertune.config, infertune.sampling_params\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
