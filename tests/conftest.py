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

from helios.catalog.load import load  # noqa: E402
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
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def cli_capture(request, tmp_path_factory) -> CliCapture:
    """``ignition capture flare-tiny`` through the CLI: six small programs (prefill, scored prefill,
    decode, and snapshot, restore, init; one slot, no drafts) and what the command printed.

    Run once per source digest, like the tiny slice: kept in pytest's cache under a file lock, so
    parallel test workers and later runs share it, and any change to the capture sources runs it anew.
    """
    import fcntl
    import json

    from typer.testing import CliRunner

    from ignition.cli import app
    from tiny_catalog import source_digest

    cache = getattr(request.config, "cache", None)
    name = f"flare-cli-capture-{source_digest()}"
    base = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    folder, printed = base / "tiny", base / "printed.json"
    with open(base / "capture.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not printed.is_file():
            # --compile none: this fixture is the exported path (the recipe compiles prefill and decode)
            result = CliRunner().invoke(app, ["capture", "flare-tiny", "--out", str(folder), *CLI_CAPTURE_OPTIONS,
                                              "--compile", "none"])
            assert result.exit_code == 0, result.output
            printed.write_text(json.dumps({"exit_code": result.exit_code, "stdout": result.stdout,
                                           "stderr": result.stderr}))
    return CliCapture(folder, **json.loads(printed.read_text()))


CLI_CAPTURE_OPTIONS = ("--concurrency", "1", "--drafts", "0", "--prefill-chunk", "64")
