"""The process's host memory: its resident set now, and the ceiling it may grow to (read once at start-up)."""

from __future__ import annotations

from pathlib import Path

import psutil

# An automatic ceiling leaves this share of what the machine could give the process to everything else.
AUTO_CEILING_SHARE = 0.9


def process_rss() -> int:
    """Resident bytes of this process (one read of /proc/self/statm on Linux, microseconds)."""
    return psutil.Process().memory_info().rss


def cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max or v1 limit_in_bytes), or None if unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 writes a huge number for "unlimited"
            return int(text)
    return None


def auto_ceiling(rss: int | None = None) -> int:
    """90% of what this process could hold: what it holds now plus what the machine has available, within the
    cgroup's limit where there is one."""
    rss = process_rss() if rss is None else rss
    reachable = rss + psutil.virtual_memory().available
    limit = cgroup_limit()
    if limit is not None:
        reachable = min(reachable, limit)
    return int(reachable * AUTO_CEILING_SHARE)
