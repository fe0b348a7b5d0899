"""Shared by every test folder: import paths, the captured tiny slice and eager twins of its programs.

``scripts`` is not an installed package (only ``helios`` and ``ignition`` are),
so the repository root goes on sys.path; tests/helios holds the helpers that
capture the tiny slice (tiny_catalog.py) and start server processes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CliCapture:
    folder: Path
    result: object  # typer's Result: exit_code, stdout, stderr


@pytest.fixture(scope="session")
def cli_capture(tmp_path_factory) -> CliCapture:
    """``ignition capture flare-tiny`` through the CLI, once per session: three small programs
    (prefill, scored prefill, decode; one slot, no drafts) and what the command printed."""
    from typer.testing import CliRunner

    from ignition.cli import app

    folder = tmp_path_factory.mktemp("cli") / "tiny"
    result = CliRunner().invoke(app, ["capture", "flare-tiny", "--out", str(folder), *CLI_CAPTURE_OPTIONS])
    assert result.exit_code == 0, result.output
    return CliCapture(folder, result)


CLI_CAPTURE_OPTIONS = ("--concurrency", "1", "--drafts", "0", "--prefill-chunk", "64")
