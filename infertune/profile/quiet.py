"""torch.profiler without kineto's start / stop chatter on stderr.

Each profiler start and stop makes libkineto write lines such as `STAGE:... Completed Stage: Warm Up` and
`USDT:... profiler_start` straight to file descriptor 2, between a tool's progress and its tables. Its only switch
(the KINETO_LOG_LEVEL environment variable, read when torch loads) hides them only together with kineto's own
errors. So `quiet_profile` sends fd 2 to a temporary file for the start and the stop alone (never while the
profiled work runs: progress bars and warnings appear as they happen), then writes back every line but those two
kinds.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

_CHATTER = ("STAGE:", "USDT:")


@contextmanager
def _kineto_chatter_dropped() -> Iterator[None]:
    """Run the body with fd 2 captured; afterwards write the captured lines back, less kineto's STAGE / USDT ones."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [
                line for line in tmp.read().decode(errors="replace").splitlines(True) if not line.startswith(_CHATTER)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextmanager
def quiet_profile(**kwargs) -> Iterator:
    """`torch.profiler.profile(**kwargs)` as a context manager, its start and stop without kineto's chatter."""
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _kineto_chatter_dropped():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _kineto_chatter_dropped():
            prof.__exit__(None, None, None)
