"""``python -m benchmarks.peers``: see benchmarks/peers/__init__.py and docs/benchmarks.md."""

import sys

from benchmarks.peers.cli import main

sys.exit(main())
