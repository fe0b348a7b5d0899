"""The training corpus: a folder's ``.py`` files, split into train and held-out by whole file.

The default folder is the running interpreter's standard library (PSF licence),
which every machine with Python has offline. Third-party packages installed
under it (``site-packages``) are skipped: they are not the stdlib and their
licences vary.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class CorpusError(ValueError):
    """A corpus folder that is missing or holds no usable ``.py`` text."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str  # relative to the corpus root, '/'-separated: the split key
    text: str


@dataclass(frozen=True, slots=True)
class Corpus:
    root: Path
    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]

    def summary(self) -> dict[str, object]:
        return {
            "root": str(self.root),
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_bytes": sum(len(f.text.encode()) for f in self.train),
            "heldout_bytes": sum(len(f.text.encode()) for f in self.heldout),
        }


def default_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str, heldout_percent: float) -> bool:
    """Deterministic whole-file split: a hash of the path, not a random draw, so reruns agree."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < heldout_percent * 100


def load_corpus(root: Path, heldout_percent: float) -> Corpus:
    files = read_sources(root)
    heldout = tuple(f for f in files if is_heldout(f.path, heldout_percent))
    train = tuple(f for f in files if not is_heldout(f.path, heldout_percent))
    if not train or not heldout:
        side = "held-out" if not heldout else "training"
        raise CorpusError(f"{root}: no file fell in the {side} split of {len(files)} files "
                          f"(--heldout-percent {heldout_percent}); use more files or another percentage")
    return Corpus(root, train, heldout)


def read_sources(root: Path) -> tuple[SourceFile, ...]:
    """Every readable, non-empty UTF-8 ``.py`` file under root, sorted by path."""
    if not root.is_dir():
        raise CorpusError(f"{root}: no such folder (expected a folder of .py files, e.g. {default_root()})")
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_FOLDERS.intersection(relative.parts) or not path.is_file():
            continue
        text = _read_text(path)
        if text and text.strip():
            files.append(SourceFile(relative.as_posix(), text))
    if not files:
        raise CorpusError(f"{root}: holds no non-empty UTF-8 .py file (expected Python sources, e.g. {default_root()})")
    return tuple(files)


def _read_text(path: Path) -> str | None:
    # The stdlib's test suite keeps a few deliberately mis-encoded files; they are skipped.
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
