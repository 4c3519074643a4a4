#!/usr/bin/env python3
"""Long contexts on a fixed KV budget: full attention, sliding windows, SnapKV and the seeds' policy side by side.

The same as `infertune bench longctx` (infertune/bench/longctx.py says what it measures and how); kept so that the
commands in BENCHMARKS.md still run.
"""

import sys

from infertune.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "longctx", *sys.argv[1:]]))
