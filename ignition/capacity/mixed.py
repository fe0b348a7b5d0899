"""``mixed_shapes``: the mixed prefill+generation programs (spec "Mixed execution contract").

Reading of the contract used here (checklist C7-C10), for every request
bucket B >= 2 (a mixed program needs a prompt row and at least one more):

- ordinary: every prompt bucket at width one, without draft-state updates;
- speculative (only when the envelope has drafts): every prompt bucket at
  width one with draft-state updates (``speculation_enabled``), plus ONE
  program per wider width W in 2..D_max+1 whose decode rows fit the
  target-token envelope, B*W <= R, at the balanced prompt bucket (the one
  minimizing max(T/T_min, T_max/T), ties to the smaller).

Wider programs are rectangular and host-allocated (query_length), D = W - 1.
The worked example (C9: ten buckets 64..4096, concurrency 4, five drafts,
R = 6) gives B in {2, 4}; width one: 10 x 2 = 20 ordinary and 20 speculative;
R = 6 admits W = 2, 3 at B = 2 and nothing at B = 4; so 22 speculative, all
wider ones at bucket 512 (= sqrt(64 * 4096)).
"""

from __future__ import annotations

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from ignition.capacity.buckets import balanced_prompt_bucket
from ignition.capacity.envelope import CapacityEnvelope, CapacityError
from ignition.capacity.separate import proposal_source
from ignition.recipes.rules import PROMPT_ALIGNMENT, is_power_of_two

MIXED_BATCH_RANGE = (2, 64)  # C7: power-of-two physical rows, 2 through 64


def mixed_shapes(env: CapacityEnvelope) -> tuple[GraphDescriptor, ...]:
    """Every mixed program for ``env``, ordinary then speculative, per batch bucket."""
    shapes: list[GraphDescriptor] = []
    for b in (b for b in env.request_buckets if b >= MIXED_BATCH_RANGE[0]):
        shapes += [_mixed(env, b, 1, t, speculative=False) for t in env.prompt_buckets]
        if env.speculative:
            shapes += [_mixed(env, b, 1, t, speculative=True) for t in env.prompt_buckets]
            shapes += [_mixed(env, b, w, balanced_prompt_bucket(env.prompt_buckets), speculative=True)
                       for w in wider_mixed_widths(env, b)]
    for shape in shapes:
        _require_contract(shape, env)
    return tuple(shapes)


def wider_mixed_widths(env: CapacityEnvelope, b: int) -> tuple[int, ...]:
    """Widths above one whose B*W target rows fit R (the target-token envelope)."""
    return tuple(w for w in range(2, env.max_width + 1) if b * w <= env.speculative_token_capacity)


def mixed_contract_problem(shape: GraphDescriptor, completion_token_capacity: int) -> str | None:
    """Why ``shape`` breaks the mixed execution contract (C7, C14), or None."""
    low, high = MIXED_BATCH_RANGE
    if not (is_power_of_two(shape.batch_capacity) and low <= shape.batch_capacity <= high):
        return f"{shape.id}: batch capacity {shape.batch_capacity} is not a power of two in {low}..{high}"
    if not 1 <= shape.width <= completion_token_capacity:
        return f"{shape.id}: width {shape.width} is outside 1..{completion_token_capacity}"
    if shape.prefill_capacity < PROMPT_ALIGNMENT or shape.prefill_capacity % PROMPT_ALIGNMENT:
        return f"{shape.id}: prompt capacity {shape.prefill_capacity} is not a positive multiple of 64"
    if shape.prefill_capacity < shape.width:
        return f"{shape.id}: prompt capacity {shape.prefill_capacity} is below the decode width {shape.width}"
    return None


def _mixed(env: CapacityEnvelope, b: int, w: int, t: int, *, speculative: bool) -> GraphDescriptor:
    wider = w > 1
    return GraphDescriptor(
        id=f"mixed_b{b}_w{w}_p{t}" + ("_spec" if speculative else ""),
        kind=GraphKind.MIXED, batch_capacity=b, proposal_depth=w - 1, width=w, aggregate=b * w,
        prefill_capacity=t, value_source=ValueSource.QUERY_LENGTH if wider else None,
        proposal_source=proposal_source(env) if speculative else None, speculation_enabled=speculative,
    )


def _require_contract(shape: GraphDescriptor, env: CapacityEnvelope) -> None:
    problem = mixed_contract_problem(shape, env.completion_token_capacity)
    if problem:
        raise CapacityError(problem)
