"""Shapes of the separate (non-mixed) program families.

prefill          batch 1, one program per prompt bucket.
scored_prefill   batch 1 at the balanced prompt bucket only: any prompt can be
                 scored in chunks of it, and its per-token log-probability
                 output stays bounded (vocab x chunk), unlike at the largest bucket.
decode           ordinary width one at every request bucket.
speculative      (only when the envelope has drafts) per request bucket B:
  - width one, D = 0, ``speculation_enabled``: keeps the draft context (C4);
  - rectangular, every W in 2..D_max+1 with P = B*W <= R, D = W - 1 (a
    program never draws proposals it cannot verify), host-allocated
    (query_length);
  - ragged, when the widest rectangular program does not fit (B*W_max > R)
    and R leaves room beyond the pending tokens (R > B): W = D_max + 1,
    P = R, once per value source: query_length (host lengths, fixed
    selection) and prefix_limit (device confidence allocation, adaptive
    selection; it declares confidence_width = D, C12; learned proposals only).
  - copy twins (id suffix ``_copy``) of every wider query_length program
    when the recipe declares both learned and copy proposals.
"""

from __future__ import annotations

import dataclasses

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from ignition.capacity.buckets import balanced_prompt_bucket
from ignition.capacity.envelope import CapacityEnvelope, CapacityError


def prefill_shapes(env: CapacityEnvelope) -> tuple[GraphDescriptor, ...]:
    return tuple(
        GraphDescriptor(id=f"prefill_p{t}", kind=GraphKind.PREFILL, batch_capacity=1, prefill_capacity=t)
        for t in env.prompt_buckets
    )


def scored_prefill_shapes(env: CapacityEnvelope) -> tuple[GraphDescriptor, ...]:
    t = balanced_prompt_bucket(env.prompt_buckets)
    return (GraphDescriptor(id=f"scored_prefill_p{t}", kind=GraphKind.SCORED_PREFILL, batch_capacity=1,
                            prefill_capacity=t),)


def decode_shapes(env: CapacityEnvelope) -> tuple[GraphDescriptor, ...]:
    return tuple(
        GraphDescriptor(id=f"decode_b{b}", kind=GraphKind.DECODE, batch_capacity=b, aggregate=b)
        for b in env.request_buckets
    )


def speculative_shapes(env: CapacityEnvelope) -> tuple[GraphDescriptor, ...]:
    """Every speculative program for the envelope; empty for an ordinary catalog."""
    if not env.speculative:
        return ()
    wider = tuple(g for b in env.request_buckets for g in (*_rectangular(env, b), *_ragged(env, b)))
    if not wider:
        raise CapacityError(
            f"--speculative-token-capacity {env.speculative_token_capacity} admits no width above one at any "
            f"request bucket {list(env.request_buckets)}; use R >= {env.request_buckets[0] + 1} "
            "(one target row beyond the smallest bucket's pending tokens), or --drafts 0 for an ordinary catalog"
        )
    return tuple(_width_one(env, b) for b in env.request_buckets) + wider + _copy_variants(env, wider)


def proposal_source(env: CapacityEnvelope) -> str:
    """The source a program draws in-graph: the draft model when the recipe has one."""
    return "learned" if "learned" in env.proposal_sources else "copy"


def _copy_variants(env: CapacityEnvelope, wider: tuple[GraphDescriptor, ...]) -> tuple[GraphDescriptor, ...]:
    """Host-supplied (prompt lookup) twins of the learned host-allocated programs, when the
    recipe declares both sources; prefix_limit allocation needs the draft's confidence, so
    it has no copy twin."""
    if not _learned(env) or "copy" not in env.proposal_sources:
        return ()
    return tuple(dataclasses.replace(g, id=f"{g.id}_copy", proposal_source="copy")
                 for g in wider if g.value_source is ValueSource.QUERY_LENGTH)


def _width_one(env: CapacityEnvelope, b: int) -> GraphDescriptor:
    return GraphDescriptor(
        id=f"spec_b{b}_d0_w1_p{b}", kind=GraphKind.SPECULATIVE, batch_capacity=b, proposal_depth=0,
        width=1, aggregate=b, proposal_source=proposal_source(env), speculation_enabled=True,
    )


def _rectangular(env: CapacityEnvelope, b: int) -> tuple[GraphDescriptor, ...]:
    widths = [w for w in range(2, env.max_width + 1) if b * w <= env.speculative_token_capacity]
    return tuple(
        GraphDescriptor(
            id=f"spec_b{b}_d{w - 1}_w{w}_p{b * w}", kind=GraphKind.SPECULATIVE, batch_capacity=b,
            proposal_depth=w - 1, width=w, aggregate=b * w, value_source=ValueSource.QUERY_LENGTH,
            proposal_source=proposal_source(env), speculation_enabled=True,
        )
        for w in widths
    )


def _ragged(env: CapacityEnvelope, b: int) -> tuple[GraphDescriptor, ...]:
    w, p = env.max_width, env.speculative_token_capacity
    if b < 2 or b * w <= p or p <= b:
        return ()
    d = env.draft_depth
    # Device allocation ranks the draft's own confidence: copy-only catalogs have none.
    sources = ((ValueSource.QUERY_LENGTH, "ql"), (ValueSource.PREFIX_LIMIT, "pl"))[: 2 if _learned(env) else 1]
    return tuple(
        GraphDescriptor(
            id=f"spec_b{b}_d{d}_w{w}_p{p}_ragged_{tag}", kind=GraphKind.SPECULATIVE, batch_capacity=b,
            proposal_depth=d, width=w, aggregate=p, ragged=True, value_source=source,
            proposal_source=proposal_source(env), speculation_enabled=True,
            confidence_width=d if source is ValueSource.PREFIX_LIMIT else 0,
        )
        for source, tag in sources
    )


def _learned(env: CapacityEnvelope) -> bool:
    return proposal_source(env) == "learned"
