"""``state_shapes``: the snapshot, restore and init programs (docs/checkpoints.md).

One of each kind at every request bucket, planned only when the recipe keeps
a checkpoint store (``checkpoints.rows`` > 0): batching state operations of
several requests into one program is the same padding trade as for inference
(spec P1 compares every prepared prerequisite shape).
"""

from __future__ import annotations

from flare_contract.graphs import GraphDescriptor, GraphKind
from ignition.capacity.envelope import CapacityEnvelope

STATE_KINDS = (GraphKind.SNAPSHOT, GraphKind.RESTORE, GraphKind.INIT)


def state_shapes(env: CapacityEnvelope) -> tuple[GraphDescriptor, ...]:
    if not env.checkpoint_rows:
        return ()
    return tuple(GraphDescriptor(f"{kind.value}_b{b}", kind, batch_capacity=b)
                 for kind in STATE_KINDS for b in env.request_buckets)
