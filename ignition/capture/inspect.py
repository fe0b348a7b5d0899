"""What ``ignition inspect`` shows: a validated catalog summarized as plain data."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare_contract.manifest import ProgramEntry, descriptor_to_dict
from helios.catalog.load import Catalog, load


@dataclass(frozen=True, slots=True)
class CatalogReport:
    catalog: Catalog
    file_sizes: dict[str, int]  # path relative to the catalog -> bytes

    @property
    def counts_by_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(p.descriptor.kind.value for p in self.catalog.manifest.programs).items()))

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes.values())

    def _program(self, entry: ProgramEntry) -> dict[str, Any]:
        files = {"file": entry.file, "bytes": self._size(entry.file)}
        if entry.compiled_file:
            files |= {"compiled_file": entry.compiled_file, "compiled_bytes": self._size(entry.compiled_file)}
        return {**descriptor_to_dict(entry.descriptor), **files}

    def _size(self, relative: str) -> int:
        """A listed file's size (``load`` has checked that it lies inside the catalog and exists)."""
        return self.file_sizes.get(relative) or (self.catalog.path / relative).stat().st_size

    def to_json(self) -> dict[str, Any]:
        manifest = self.catalog.manifest
        return {
            "path": str(self.catalog.path),
            "format_version": manifest.format_version,
            "flare_version": manifest.flare_version,
            "torch_version": manifest.torch_version,
            "compile": manifest.compile,
            "recipe": dict(manifest.recipe),
            "device": dict(manifest.device),
            "envelope": manifest.envelope.to_dict(),
            "counts_by_kind": self.counts_by_kind,
            "programs": [self._program(p) for p in manifest.programs],
            "files": self.file_sizes,
            "total_bytes": self.total_bytes,
        }


def inspect_catalog(path: str | Path) -> CatalogReport:
    """Load and validate the catalog at ``path`` and measure its files."""
    catalog = load(path)
    sizes = {
        str(f.relative_to(catalog.path)): f.stat().st_size for f in sorted(catalog.path.rglob("*")) if f.is_file()
    }
    return CatalogReport(catalog, sizes)
