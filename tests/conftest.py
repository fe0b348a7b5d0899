"""Shared by every test folder: import paths, the captured tiny slice and eager twins of its programs.

``scripts`` is not an installed package (only ``helios`` and ``ignition`` are),
so the repository root goes on sys.path; tests/helios holds the helpers that
capture the tiny slice (tiny_catalog.py) and start server processes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests" / "helios"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from helios.catalog import load  # noqa: E402
from tiny_catalog import cache_folder, eager_programs, tiny_catalog_path  # noqa: E402


@pytest.fixture(scope="session")
def catalog(request, tmp_path_factory):
    """The tiny slice of the bundled catalog (captured once per source digest, tests/helios/tiny_catalog.py)."""
    return load(tiny_catalog_path(cache_folder(request.config, tmp_path_factory)))


@pytest.fixture(scope="session")
def eager(catalog):
    """``program_for`` over eager twins of the slice's programs (bitwise equal, loaded in milliseconds)."""
    return eager_programs(catalog)
