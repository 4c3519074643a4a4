"""`python -m infertune ...` is the `infertune` command."""

import sys

from infertune.cli import main

sys.exit(main())
