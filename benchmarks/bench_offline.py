#!/usr/bin/env python3
"""Same as `infertune bench throughput`: infertune vs HF transformers generate, side by side (see --help)."""

import sys

from infertune.bench.offline import main

if __name__ == "__main__":
    sys.exit(main())
