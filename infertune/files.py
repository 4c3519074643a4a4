"""Output files of the commands (--json, --trace, --plot, --md, --out-config): checked before the long work they end,
so that a path that cannot be written is a one-line error at once, not a traceback after a whole run."""

from __future__ import annotations

import os
import tempfile
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
        while not folder.is_dir():
            folder = folder.parent
    target = p if p.exists() else folder
    try:  # (tried, not os.access: root passes that check where the file system still refuses, e.g. /proc)
        if p.exists():
            with open(p, "a"):
                pass
        else:
            tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {target} is not writable ({e.strerror})") from None
