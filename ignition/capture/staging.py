"""Atomic catalog folders: build beside the target, rename into place when complete.

A reader either sees the previous complete catalog, the new complete one, or
nothing; never a half-written folder. The staging folder sits in the target's
parent so the final rename stays on one filesystem.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flare_contract.manifest import MANIFEST_NAME


class StagingError(OSError):
    """The output folder cannot be prepared (unwritable parent, a file in the way...)."""


@contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """Yield an empty folder to fill; on clean exit it replaces ``target`` atomically.

    If the body raises (or the process dies), ``target`` is left exactly as it was
    and the staging folder is removed (or, after a crash, left as an ignorable
    ``.<name>.staging-*`` folder that never has a manifest at ``target``).
    """
    target = target.absolute()
    parent = check_target(target)
    staging = parent / f".{target.name}.staging-{secrets.token_hex(6)}"
    staging.mkdir()  # not mkdtemp: the catalog keeps the umask's permissions, not 0700
    try:
        yield staging
        _replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_target(target: Path) -> Path:
    """The folder the catalog will be renamed into; raises ``StagingError`` if unusable."""
    target = target.absolute()
    parent = target.parent
    _check_replaceable(target)
    blocking = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise StagingError(f"{blocking}: is a file, not a folder; choose an --out inside a writable folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StagingError(f"{parent}: cannot create the output folder ({exc.strerror})") from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise StagingError(f"{parent}: not writable; choose an --out inside a writable folder")
    return parent


def _check_replaceable(target: Path) -> None:
    """Only a previous catalog (or an empty folder) may be replaced: never a user's other files."""
    if not target.exists():
        return
    if not target.is_dir():
        raise StagingError(f"{target}: exists and is not a folder; choose another --out")
    if any(target.iterdir()) and not (target / MANIFEST_NAME).is_file():
        raise StagingError(f"{target}: exists and is not a catalog (no {MANIFEST_NAME}); "
                           "choose a new or empty folder for --out")


def _replace(staging: Path, target: Path) -> None:
    """Swap the finished folder in; the old catalog is removed only afterwards."""
    if not target.exists():
        os.rename(staging, target)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.retired-", dir=target.parent))
    os.rename(target, retired / target.name)
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(retired / target.name, target)  # put the old catalog back
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)
