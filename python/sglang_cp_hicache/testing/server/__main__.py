"""``python -m sglang_cp_hicache.testing.server``: see :mod:`sglang_cp_hicache.testing.server.cli`."""

import sys

from sglang_cp_hicache.testing.server.cli import main

sys.exit(main())
