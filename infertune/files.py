"""Output files of the commands (--json, --trace, --plot, --md, --out-config): checked before the long work they end,
so that a path that cannot be written is a one-line error at once, not a traceback after a whole run."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def check_writable(flag: str, path: str | os.PathLike | None, make_parents: bool = False) -> None:
    """ValueError naming `flag` where `path` cannot be written: it is a folder, its folder is missing (unless
    make_parents: the command creates it, so its nearest existing ancestor must be writable) or not writable. None
    and "-" (stdout) pass."""
    if path is None or str(path) in ("", "-"):
        return
    p = Path(path).resolve()
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    folder = p.parent
    if not folder.is_dir():
        if not make_parents:
            raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():  # (mkdir of the parents would fail on it)
            raise ValueError(f"{flag} {path}: {folder} is a file")
    target = p if p.exists() else folder
    try:  # (tried, not os.access: root passes that check where the file system still refuses, e.g. /proc)
        if p.exists():
            with open(p, "a"):
                pass
        else:
            tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {target} is not writable ({e.strerror})") from None


def check_writable_folder(flag: str, path: str | os.PathLike) -> None:
    """ValueError naming `flag` where the output folder `path` cannot be made or written into: it is a file, an
    ancestor is a file, or the folder (or its nearest existing ancestor, when the command creates it) refuses a
    new file."""
    p = Path(path).resolve()
    folder = p
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        what = "is a file" if folder == p else f"{folder} is a file"
        raise ValueError(f"{flag} {path}: {what}; give a folder")
    try:  # (tried, not os.access: root passes that check where the file system still refuses, e.g. /proc)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {folder} is not writable ({e.strerror})") from None


# ---- --json [OUT]: one meaning in every command --------------------------------------------------------------------

JSON_STDOUT = "-"  # bare --json


def add_json_flag(p, what: str) -> None:
    """--json [OUT] as every command takes it: OUT a file the JSON is written to (the report printed as usual);
    bare, the JSON printed to stdout in place of the report (progress and tables to stderr)."""
    p.add_argument(
        "--json",
        nargs="?",
        const=JSON_STDOUT,
        default=None,
        metavar="OUT",
        help=f"{what} as JSON: written to the file OUT, or, with no OUT, printed to stdout in place of the report",
    )


def json_to_stdout(args) -> bool:
    return getattr(args, "json", None) == JSON_STDOUT


_json_stream = None  # the real stdout while a command with a bare --json runs (report_to_stderr)


def emit_json(target, doc, indent: int = 1) -> None:
    """--json's document: to the file `target` (its folder made), to stdout for a bare --json (the real one where
    report_to_stderr moved the command's prints to stderr), nowhere for None."""
    if target is None:
        return
    import json
    import sys

    text = json.dumps(doc, indent=indent, default=str) + "\n"
    if str(target) == JSON_STDOUT:
        out = _json_stream or sys.stdout
        out.write(text)
        out.flush()
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def print_report(args, text: str, doc, indent: int = 1) -> None:
    """A command's report: the text to stdout and --json OUT's file; with a bare --json the JSON to stdout and the
    text to stderr."""
    import sys

    print(text, file=sys.stderr if json_to_stdout(args) else sys.stdout)
    emit_json(getattr(args, "json", None), doc, indent=indent)


@contextmanager
def report_to_stderr(args):
    """Around a whole command (cli.main): with a bare --json, whatever it prints (progress, tables) goes to stderr,
    and stdout holds the JSON alone."""
    global _json_stream
    import sys
    from contextlib import redirect_stdout

    if not json_to_stdout(args):
        yield
        return
    _json_stream = sys.stdout
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stream = None
