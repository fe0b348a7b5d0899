"""A program's outputs, checked and copied to the host (program contract version 2, "Outputs").

``read_outputs`` turns the tensors one frame returned into plain per-row
values the executor builds ``CompletionRecord``s from: committed tokens,
verified lengths (``offered = verified_lens - 1`` on decode rows), rank zero's
joint-prefix confidence per slot (C12) and survival products per row (C13);
and, for the rows whose requests asked, each committed token's logprob and
top alternatives (program contract version 3), copied for those rows only.

Everything is validated here, before a single record exists (A2): wrong
shapes, verified lengths that differ from what the host asked, exceed a
prefix-limit lane's ceiling or the program's P, and probabilities outside
[0, 1] raise ``FrameOutputError``. The engine then fails that frame's
requests; the scheduler never sees a malformed completion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flare_contract.graphs import GraphDescriptor
from helios.runtime.engine_api import Alternative, TokenLogprob
from helios.scheduler.types import LanePhase

LOGPROB_SLACK = 1e-4  # a log-softmax may round a hair above 0; anything beyond is not a log-probability


class FrameOutputError(ValueError):
    """A program returned outputs that break the program contract."""


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class FrameOutputs:
    """One frame's outputs on the host, by row (and by slot for confidence)."""

    tokens: tuple[tuple[int, ...], ...]  # per row: its num_tokens committed tokens
    verified: tuple[int, ...] | None  # verified_lens per row; None for programs without it
    confidence: tuple[tuple[float, ...], ...] | None  # per slot: joint prefix probabilities [1, slot, :]
    survival: tuple[tuple[float, ...], ...] | None  # per row: cumulative min(1, p/q) products
    logprobs: Mapping[int, tuple[TokenLogprob, ...]] = None  # row -> its committed tokens' logprobs (rows asked)
    prompt_scores: tuple[TokenLogprob, ...] | None = None  # scored prefill: each chunk token's successor, scored

    def offered(self, row) -> int:
        """Drafts the row verified: the program's count where it reports one, else the host's."""
        return row.offered if self.verified is None else self.verified[row.row] - 1

    def confidence_row(self, slot: int) -> tuple[float, ...] | None:
        return None if self.confidence is None else self.confidence[slot]

    def survival_row(self, row: int, offered: int) -> tuple[float, ...] | None:
        """Only the verified positions: the rest are zero by contract and say nothing (S10)."""
        if self.survival is None or offered <= 0:
            return None
        return self.survival[row][:offered]


def read_outputs(graph: GraphDescriptor, rows: Sequence, outputs: Mapping[str, Any], slots: int,
                 wanting: Sequence = ()) -> FrameOutputs:
    """Checked host copies of ``outputs`` for the bound ``rows`` of a ``graph`` frame over ``slots`` slots;
    logprobs for the bound rows in ``wanting``."""
    b = graph.batch_capacity
    tokens = _host(graph, outputs, "tokens", (b, graph.width))
    counts = _host(graph, outputs, "num_tokens", (b,))
    verified = _verified(graph, rows, outputs)
    _check_counts(graph, rows, counts, verified)
    committed = tuple(tuple(tokens[i][: counts[i]]) for i in range(b))
    return FrameOutputs(
        tokens=committed,
        verified=verified,
        confidence=_confidence(graph, outputs, slots),
        survival=_probabilities(graph, outputs, "survival", (b, max(graph.proposal_depth, 1))),
        logprobs={row.row: _row_logprobs(graph, outputs, row.row, committed[row.row]) for row in wanting},
        prompt_scores=_prompt_scores(graph, rows, outputs),
    )


def _prompt_scores(graph: GraphDescriptor, rows: Sequence, outputs: Mapping[str, Any]) -> tuple[TokenLogprob, ...] | None:
    """A scored prefill's prompt row: for chunk position i, the prompt token after it with its logprob and
    the best alternatives there (spec C1). The last position of a final chunk scores nothing (no token follows)."""
    if "logprobs" not in outputs or not rows:
        return None
    lane = rows[0].lane
    length = lane.prompt_tokens - (1 if lane.finishes_prompt else 0)
    scored = _host(graph, outputs, "logprobs", (graph.prefill_capacity,))[:length]
    if "prompt_top_logprobs" not in outputs:
        raise FrameOutputError(f"{graph.id}: scored prefill without 'prompt_top_logprobs' (program contract 3)")
    best = outputs["prompt_top_logprobs"][:length].tolist()
    best_ids = outputs["prompt_top_token_ids"][:length].tolist()
    bad = next((v for v in [*scored, *(v for top in best for v in top)] if not v <= LOGPROB_SLACK), None)
    if bad is not None:
        raise FrameOutputError(f"{graph.id}: prompt logprob {bad} is not a log-probability")
    return tuple(TokenLogprob(-1, min(p, 0.0), tuple(Alternative(i, min(v, 0.0)) for i, v in zip(ids, top)))
                 for p, ids, top in zip(scored, best_ids, best))


def _row_logprobs(graph: GraphDescriptor, outputs: Mapping[str, Any], row: int,
                  tokens: tuple[int, ...]) -> tuple[TokenLogprob, ...]:
    """One row's committed tokens with their logprob and top alternatives, checked."""
    for name in ("token_logprobs", "top_logprobs", "top_token_ids"):
        if name not in outputs:
            raise FrameOutputError(f"{graph.id}: a request asked for logprobs but the program returned no {name!r} "
                                   "(a catalog older than program contract 3?)")
    n = len(tokens)
    picked = outputs["token_logprobs"][row, :n].tolist()
    best = outputs["top_logprobs"][row, :n].tolist()
    best_ids = outputs["top_token_ids"][row, :n].tolist()
    bad = next((v for v in [*picked, *(v for top in best for v in top)] if not v <= LOGPROB_SLACK), None)
    if bad is not None:
        raise FrameOutputError(f"{graph.id} row {row}: logprob {bad} is not a log-probability")
    return tuple(TokenLogprob(t, min(p, 0.0), tuple(Alternative(i, min(v, 0.0)) for i, v in zip(ids, top)))
                 for t, p, ids, top in zip(tokens, picked, best_ids, best))


def _host(graph: GraphDescriptor, outputs: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> list:
    if name not in outputs:
        raise FrameOutputError(f"{graph.id}: no {name!r} output; the program returned {sorted(outputs)}")
    tensor = outputs[name]
    if tuple(tensor.shape) != shape:
        raise FrameOutputError(f"{graph.id}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor.tolist()


def _verified(graph: GraphDescriptor, rows: Sequence, outputs: Mapping[str, Any]) -> tuple[int, ...] | None:
    """verified_lens, checked against what the host asked: equal, or within a prefix-limit ceiling."""
    if "verified_lens" not in outputs:
        return None
    verified = tuple(_host(graph, outputs, "verified_lens", (graph.batch_capacity,)))
    device_allocated = graph.is_prefix_limit
    for row in rows:
        got, asked = verified[row.row], row.query_length
        if device_allocated and row.lane.phase is LanePhase.DECODE:
            if not 1 <= got <= asked:
                raise FrameOutputError(f"{graph.id} row {row.row}: verified {got} rows, outside 1..its ceiling {asked}")
        elif got != asked:
            raise FrameOutputError(f"{graph.id} row {row.row}: verified {got} rows but the host bound {asked}")
    used = sum(verified[row.row] for row in rows if row.lane.phase is LanePhase.DECODE)
    if device_allocated and used > graph.target_rows:
        raise FrameOutputError(f"{graph.id}: rows verify {used} target rows, more than P = {graph.target_rows}")
    return verified


def _check_counts(graph: GraphDescriptor, rows: Sequence, counts: Sequence[int], verified) -> None:
    for row in rows:
        count = counts[row.row]
        if row.lane.phase is LanePhase.PROMPT:
            ceiling = 1 if row.lane.finishes_prompt else 0
        else:
            ceiling = row.query_length if verified is None else verified[row.row]
        low = 1 if row.lane.phase is LanePhase.DECODE else 0
        if not low <= count <= ceiling:
            raise FrameOutputError(f"{graph.id} row {row.row}: num_tokens {count} outside {low}..{ceiling}")


def _confidence(graph: GraphDescriptor, outputs: Mapping[str, Any], slots: int) -> tuple | None:
    """Rank zero's joint prefix probabilities per slot ([1, slot, :]); required where declared (C12)."""
    if graph.confidence_width <= 0:
        return None
    if "confidence" not in outputs:
        raise FrameOutputError(f"{graph.id}: declares confidence_width {graph.confidence_width} "
                               "but returned no 'confidence' output")
    sidecar = _probabilities(graph, outputs, "confidence", (2, slots, graph.confidence_width))
    return sidecar[slots:]  # the second plane: joint prefix probabilities, one row per slot


def _probabilities(graph: GraphDescriptor, outputs: Mapping[str, Any], name: str, shape) -> tuple | None:
    """A float output flattened to rows of its last axis, every value a probability."""
    if name not in outputs:
        return None
    values = _host(graph, outputs, name, shape)
    flat = [tuple(row) for plane in values for row in plane] if len(shape) == 3 else [tuple(r) for r in values]
    bad = next((p for row in flat for p in row if not (math.isfinite(p) and 0.0 <= p <= 1.0)), None)
    if bad is not None:
        raise FrameOutputError(f"{graph.id}: {name} holds {bad}, not a probability in [0, 1]")
    return tuple(flat)
