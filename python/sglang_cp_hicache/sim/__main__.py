"""``python -m sglang_cp_hicache.sim``."""

import sys

from sglang_cp_hicache.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
