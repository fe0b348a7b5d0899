"""Fixtures shared by the engine-level tests: the captured tiny slice and eager twins of its programs."""

from __future__ import annotations

import pytest

from helios.catalog import load
from tiny_catalog import cache_folder, eager_programs, tiny_catalog_path


@pytest.fixture(scope="session")
def catalog(request, tmp_path_factory):
    """The tiny slice of the bundled catalog (captured once per source digest, tests/helios/tiny_catalog.py)."""
    return load(tiny_catalog_path(cache_folder(request.config, tmp_path_factory)))


@pytest.fixture(scope="session")
def eager(catalog):
    """``program_for`` over eager twins of the slice's programs (bitwise equal, loaded in milliseconds)."""
    return eager_programs(catalog)
