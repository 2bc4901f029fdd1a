"""`python3 -m bench.harness` (what bench/run.sh runs, from the repository's root)."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
