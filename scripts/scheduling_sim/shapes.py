"""The captured programs a baseline may run, and the smallest one that fits a chosen batch.

Baselines think in batches and chunks (n decoders, a 300-token chunk, width
k + 1); a prepared catalog only has fixed shapes. ``Shapes`` answers "which
captured program holds this work with the least padding": the smallest batch
capacity at or above the rows, then the smallest prompt capacity at or above
the chunk, ties to the shorter duration. Only host-allocated rectangular
programs are offered (``query_length``, not ragged): every baseline fixes its
lane widths itself, as the schedulers they model do.
"""

from __future__ import annotations

from typing import Callable

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from helios.sim.files import SyntheticCatalog


class Shapes:
    def __init__(self, catalog: SyntheticCatalog):
        usable = [g for g in catalog.graphs if _host_allocated(g.descriptor)]
        usable.sort(key=lambda g: (g.descriptor.batch_capacity, g.descriptor.prefill_capacity, g.duration_ns))
        self._graphs = tuple(g.descriptor for g in usable)
        self._duration_ns = {g.descriptor.id: g.duration_ns for g in catalog.graphs}
        self.request_slots = catalog.request_slots

    def duration_ns(self, graph: GraphDescriptor) -> int:
        """The catalog's nominal duration: what a baseline that 'knows its costs' plans with."""
        return self._duration_ns[graph.id]

    def _smallest(self, keep: Callable[[GraphDescriptor], bool]) -> GraphDescriptor | None:
        return next((g for g in self._graphs if keep(g)), None)

    def _largest(self, keep: Callable[[GraphDescriptor], bool], measure: Callable[[GraphDescriptor], int]) -> int:
        return max((measure(g) for g in self._graphs if keep(g)), default=0)

    def decode(self, rows: int, width: int = 1) -> GraphDescriptor | None:
        """Smallest decode (width 1) or speculative (width > 1) program with >= rows rows."""
        kind = GraphKind.DECODE if width == 1 else GraphKind.SPECULATIVE
        return self._smallest(lambda g: g.kind is kind and g.width == width and g.batch_capacity >= rows)

    def max_decode_rows(self, width: int = 1) -> int:
        kind = GraphKind.DECODE if width == 1 else GraphKind.SPECULATIVE
        return self._largest(lambda g: g.kind is kind and g.width == width, lambda g: g.batch_capacity)

    def speculative_widths(self) -> tuple[int, ...]:
        """Every captured round width above one (k = width - 1 drafts)."""
        return tuple(sorted({g.width for g in self._graphs if g.kind is GraphKind.SPECULATIVE}))

    def prefill(self, tokens: int, rows: int = 1) -> GraphDescriptor | None:
        return self._smallest(
            lambda g: g.kind is GraphKind.PREFILL and g.batch_capacity >= rows and g.prefill_capacity >= tokens
        )

    def max_prefill_chunk(self, rows: int = 1) -> int:
        return self._largest(
            lambda g: g.kind is GraphKind.PREFILL and g.batch_capacity >= rows, lambda g: g.prefill_capacity
        )

    def max_prefill_rows(self) -> int:
        return self._largest(lambda g: g.kind is GraphKind.PREFILL, lambda g: g.batch_capacity)

    def mixed(self, decoders: int, tokens: int, width: int = 1) -> GraphDescriptor | None:
        """Smallest mixed program with one prompt row of >= tokens beside ``decoders`` rows of ``width``."""
        return self._smallest(
            lambda g: g.kind is GraphKind.MIXED
            and g.width == width
            and g.batch_capacity >= decoders + 1
            and g.prefill_capacity >= tokens
        )

    def max_mixed_chunk(self, decoders: int, width: int = 1) -> int:
        return self._largest(
            lambda g: g.kind is GraphKind.MIXED and g.width == width and g.batch_capacity >= decoders + 1,
            lambda g: g.prefill_capacity,
        )

    def has_mixed(self) -> bool:
        return any(g.kind is GraphKind.MIXED for g in self._graphs)


def _host_allocated(graph: GraphDescriptor) -> bool:
    device_allocated = graph.value_source is ValueSource.PREFIX_LIMIT or graph.ragged
    # Speculation-enabled width-one variants exist for Helios's mode switching; a baseline's
    # plain decode uses the ordinary program. Wider programs keep the flag only as a catalog
    # may set it on every speculative program (the bundled capture does), so it says nothing there.
    width_one_variant = graph.speculation_enabled and graph.width == 1
    return not device_allocated and not width_one_variant and graph.proposal_depth >= graph.width - 1
