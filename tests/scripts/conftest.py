"""Make the repository root importable so tests can import ``scripts.scheduling_sim``.

``scripts`` is not an installed package (only ``helios`` and ``ignition`` are), and
pytest puts only this test folder on sys.path.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
