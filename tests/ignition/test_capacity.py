"""Capacity planning: bucket math, speculative coverage, mixed_shapes (checklist C3-C5, C7-C10)."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flare_contract.graphs import GraphKind, ValueSource
from ignition.capacity import (
    CapacityEnvelope,
    CapacityError,
    CapacityOptions,
    balanced_prompt_bucket,
    mixed_contract_problem,
    mixed_shapes,
    plan_capacity,
    plan_graphs,
    request_buckets_through,
)
from ignition.recipes import load_recipe

WORKED_BUCKETS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
EXAMPLES = 50 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 200


def envelope(**changes) -> CapacityEnvelope:
    base = dict(
        request_slots=4, request_buckets=(1, 2, 4), prompt_buckets=(64, 256, 1024, 4096), draft_depth=3,
        speculative_token_capacity=8, completion_token_capacity=8, mixed=True, proposal_sources=("learned",),
        context_length=4096,
    )
    return CapacityEnvelope(**(base | changes))


def of_kind(graphs, kind):
    return [g for g in graphs if g.kind is kind]


# -- buckets -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("concurrency", "buckets"),
    [(1, (1,)), (2, (1, 2)), (3, (1, 2, 4)), (4, (1, 2, 4)), (5, (1, 2, 4, 8)), (64, (1, 2, 4, 8, 16, 32, 64))],
)
def test_C5_request_buckets_are_powers_of_two_through_padded_concurrency(concurrency, buckets):
    assert request_buckets_through(concurrency) == buckets


def test_C5_declared_request_buckets_thin_the_ladder_but_keep_the_top():
    assert request_buckets_through(16, (1, 4)) == (1, 4, 16)
    assert request_buckets_through(3, (1, 4)) == (1, 4)


@pytest.mark.parametrize(
    ("buckets", "chosen"),
    [
        (WORKED_BUCKETS, 512),  # sqrt(64 * 4096) = 512: ratio 8 both ways
        ((64, 256, 1024, 4096), 256),  # 256 and 1024 tie at ratio 16: the smaller wins
        ((64, 128, 4096), 128),  # 128: max(2, 32); 64: 64; 4096: 64
        ((64, 3072, 4096), 3072),  # 3072: max(48, 4/3) = 48 beats 64
        ((256,), 256),
    ],
)
def test_C8_balanced_prompt_bucket_minimizes_worst_ratio_ties_to_smaller(buckets, chosen):
    assert balanced_prompt_bucket(buckets) == chosen


# -- the spec's worked example -----------------------------------------------------------------------


def test_C9_worked_example_22_speculative_and_20_ordinary_mixed_graphs():
    """Ten buckets 64..4096, concurrency 4, five drafts, R = 6 (see docs/cli.md for the reading)."""
    env = envelope(prompt_buckets=WORKED_BUCKETS, draft_depth=5, speculative_token_capacity=6)
    shapes = mixed_shapes(env)
    speculative = [g for g in shapes if g.speculation_enabled]
    ordinary = [g for g in shapes if not g.speculation_enabled]
    assert (len(speculative), len(ordinary)) == (22, 20)
    assert {g.batch_capacity for g in shapes} == {2, 4}
    wider = [g for g in speculative if g.width > 1]
    assert sorted((g.batch_capacity, g.width) for g in wider) == [(2, 2), (2, 3)]
    assert {g.prefill_capacity for g in wider} == {512}
    assert all(g.width == 1 and g.proposal_depth == 0 for g in ordinary)


def test_C9_worked_example_through_the_flash_recipe():
    plan = plan_capacity(load_recipe("qwen3.8-flash"), CapacityOptions(mixed_prefill=True))
    mixed = of_kind(plan.graphs, GraphKind.MIXED)
    assert Counter(g.speculation_enabled for g in mixed) == {True: 22, False: 20}
    assert plan.envelope.speculative_token_capacity == 6 and plan.envelope.max_width == 6


def test_C9_ordinary_catalog_has_only_ordinary_mixed_graphs():
    shapes = mixed_shapes(envelope(draft_depth=0))
    assert len(shapes) == 4 * 2 and not any(g.speculation_enabled for g in shapes)


def test_C8_wider_mixed_widths_follow_the_target_token_envelope():
    shapes = mixed_shapes(envelope(speculative_token_capacity=8))  # W_max = 4
    wider = sorted((g.batch_capacity, g.width) for g in shapes if g.width > 1)
    assert wider == [(2, 2), (2, 3), (2, 4), (4, 2)]
    assert {g.prefill_capacity for g in shapes if g.width > 1} == {256}


# -- mixed contract ------------------------------------------------------------------------------


def test_C7_every_planned_mixed_graph_keeps_the_contract():
    for g in mixed_shapes(envelope()):
        assert mixed_contract_problem(g, 8) is None
        assert g.prefill_capacity % 64 == 0 and g.prefill_capacity >= g.width


def test_C7_contract_check_rejects_bad_shapes():
    good = mixed_shapes(envelope())[0]
    assert "power of two" in mixed_contract_problem(dataclasses.replace(good, batch_capacity=3, aggregate=3), 8)
    assert "power of two" in mixed_contract_problem(dataclasses.replace(good, batch_capacity=1, aggregate=1), 8)
    assert "multiple of 64" in mixed_contract_problem(dataclasses.replace(good, prefill_capacity=100), 8)
    wide = dataclasses.replace(good, width=9, aggregate=good.batch_capacity * 9)
    assert "outside 1..8" in mixed_contract_problem(wide, 8)


def test_C7_other_families_have_no_prefill_capacity():
    graphs = plan_graphs(envelope())
    for g in graphs:
        has_prompt = g.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.MIXED)
        assert (g.prefill_capacity > 0) == has_prompt, g.id


def test_C10_max_packed_extent():
    plan = plan_capacity(load_recipe("flare-tiny"), CapacityOptions(mixed_prefill=True))
    mixed = of_kind(plan.graphs, GraphKind.MIXED)
    for g in mixed:
        assert g.max_packed_tokens == g.prefill_capacity + (g.batch_capacity - 1) * g.width
    # the widest extent: the 4096 prompt row plus fifteen width-one decode rows (16 request slots)
    assert plan.max_packed_tokens == 4096 + 15 * 1
    assert plan.to_dict()["max_packed_tokens"] == plan.max_packed_tokens


# -- C3 ------------------------------------------------------------------------------------------


def test_C3_mixed_prefill_needs_the_recipe_declaration():
    recipe = load_recipe("qwen3.8-flash")
    undeclared = dataclasses.replace(recipe, capacity=dataclasses.replace(recipe.capacity, mixed_capture=False))
    with pytest.raises(CapacityError, match="does not declare mixed capture"):
        plan_capacity(undeclared, CapacityOptions(mixed_prefill=True))
    assert not of_kind(plan_capacity(recipe).graphs, GraphKind.MIXED)  # declared, but not asked for
    assert of_kind(plan_capacity(recipe, CapacityOptions(mixed_prefill=True)).graphs, GraphKind.MIXED)


# -- speculative coverage --------------------------------------------------------------------------


def test_C4_width_one_programs_have_depth_zero_and_keep_draft_context():
    graphs = plan_graphs(envelope(mixed=False))
    width_one = [g for g in of_kind(graphs, GraphKind.SPECULATIVE) if g.width == 1]
    assert sorted(g.batch_capacity for g in width_one) == [1, 2, 4]
    assert all(g.proposal_depth == 0 and g.speculation_enabled for g in width_one)
    decode = of_kind(graphs, GraphKind.DECODE)
    assert sorted(g.batch_capacity for g in decode) == [1, 2, 4]
    assert not any(g.speculation_enabled for g in decode)


def test_C4_C5_rectangular_and_ragged_programs_for_flare_tiny_defaults():
    spec = of_kind(plan_graphs(envelope(mixed=False)), GraphKind.SPECULATIVE)
    rect = sorted((g.batch_capacity, g.width, g.aggregate) for g in spec if g.width > 1 and not g.ragged)
    assert rect == [(1, 2, 2), (1, 3, 3), (1, 4, 4), (2, 2, 4), (2, 3, 6), (2, 4, 8), (4, 2, 8)]
    ragged = [g for g in spec if g.ragged]
    assert {(g.batch_capacity, g.width, g.aggregate) for g in ragged} == {(4, 4, 8)}
    assert {g.value_source for g in ragged} == {ValueSource.QUERY_LENGTH, ValueSource.PREFIX_LIMIT}
    for g in ragged:
        assert g.confidence_width == (g.proposal_depth if g.value_source is ValueSource.PREFIX_LIMIT else 0)


@pytest.mark.parametrize("sources", [("learned",), ("copy",), ("learned", "copy"), ("copy", "learned")])
def test_copy_twins_exist_exactly_when_the_recipe_declares_both_sources(sources):
    """Program contract v2 item 9: copy twins of the learned query_length programs; prefix_limit and
    wider mixed programs stay learned whenever a draft exists."""
    graphs = plan_graphs(envelope(proposal_sources=sources))
    spec = of_kind(graphs, GraphKind.SPECULATIVE)
    learned = [g for g in spec if g.proposal_source == "learned"]
    twins = [g for g in spec if g.id.endswith("_copy")]
    if set(sources) == {"learned", "copy"}:
        wider_ql = [g for g in learned if g.width > 1 and g.value_source is ValueSource.QUERY_LENGTH]
        assert sorted(g.id for g in twins) == sorted(f"{g.id}_copy" for g in wider_ql)
        assert all(dataclasses.replace(t, id=t.id.removesuffix("_copy"), proposal_source="learned") in wider_ql
                   for t in twins)
    else:
        assert not twins
        assert {g.proposal_source for g in spec} == {sources[0]}
    prefix_limit = [g for g in spec if g.value_source is ValueSource.PREFIX_LIMIT]
    assert {g.proposal_source for g in prefix_limit} == ({"learned"} if "learned" in sources else set())
    wider_mixed = [g for g in of_kind(graphs, GraphKind.MIXED) if g.width > 1]
    assert wider_mixed and {g.proposal_source for g in wider_mixed} == {"learned" if "learned" in sources else "copy"}


def test_C5_too_small_R_is_an_error_naming_a_fix():
    with pytest.raises(CapacityError, match=r"admits no width above one.*R >= 2"):
        plan_graphs(envelope(speculative_token_capacity=1))
    with pytest.raises(CapacityError, match=r"R >= 3"):
        plan_graphs(envelope(request_slots=4, request_buckets=(2, 4), speculative_token_capacity=2))
    # R = 3 is enough there: a ragged B = 2 program lets one lane verify a draft
    spec = of_kind(plan_graphs(envelope(request_buckets=(2, 4), speculative_token_capacity=3)), GraphKind.SPECULATIVE)
    assert {(g.batch_capacity, g.aggregate) for g in spec if g.ragged} == {(2, 3)}  # B = 4 needs P > 4


def test_C5_smallest_R_gives_one_wider_program():
    spec = of_kind(plan_graphs(envelope(speculative_token_capacity=2, mixed=False)), GraphKind.SPECULATIVE)
    assert [(g.batch_capacity, g.width) for g in spec if g.width > 1] == [(1, 2)]


def test_drafts_zero_plans_the_ordinary_catalog_even_with_tiny_R():
    graphs = plan_graphs(envelope(draft_depth=0, speculative_token_capacity=1))
    assert not of_kind(graphs, GraphKind.SPECULATIVE)
    assert not any(g.speculation_enabled for g in graphs)


def test_default_R_covers_one_full_width_request_and_width_two_at_the_top_bucket():
    recipe = load_recipe("flare-tiny")  # its declared R (16) removed: the derived default
    recipe = dataclasses.replace(recipe, capacity=dataclasses.replace(recipe.capacity, speculative_token_capacity=None))
    env = plan_capacity(recipe).envelope
    assert env.speculative_token_capacity >= env.max_width
    assert env.speculative_token_capacity >= 2 * env.request_buckets[-1]


# -- options -------------------------------------------------------------------------------------


def test_options_override_recipe_defaults():
    plan = plan_capacity(
        load_recipe("flare-tiny"),
        CapacityOptions(concurrency=3, prefill_chunk=512, drafts=1, speculative_token_capacity=4),
    )
    env = plan.envelope
    assert env.request_buckets == (1, 2, 4) and env.request_slots == 3
    assert env.prompt_buckets == (64, 256, 512)
    assert {g.prefill_capacity for g in of_kind(plan.graphs, GraphKind.PREFILL)} == {64, 256, 512}
    assert max(g.width for g in plan.graphs) == 2


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (CapacityOptions(prefill_chunk=100), "multiple of 64"),
        (CapacityOptions(prefill_chunk=0), "multiple of 64"),
        (CapacityOptions(prefill_chunk=8192), "context of 4096"),
        (CapacityOptions(concurrency=0), "outside 1..64"),
        (CapacityOptions(concurrency=65), "outside 1..64"),
        (CapacityOptions(drafts=8), "--drafts 0 through 7"),
        (CapacityOptions(drafts=-1), "--drafts 0 through 7"),
        (CapacityOptions(speculative_token_capacity=0), "not positive"),
    ],
)
def test_bad_options_are_one_line_errors(options, words):
    with pytest.raises(CapacityError, match=words) as info:
        plan_capacity(load_recipe("flare-tiny"), options)
    assert "\n" not in str(info.value)


def test_C5_non_power_of_two_batch_bucket_is_rejected():
    with pytest.raises(CapacityError, match="not ascending powers of two"):
        envelope(request_buckets=(1, 3, 4))
    with pytest.raises(CapacityError, match="ending at the padded concurrency 4"):
        envelope(request_buckets=(1, 2))


def test_C7_prompt_buckets_must_be_ascending_multiples_of_64():
    with pytest.raises(CapacityError, match="not a positive multiple of 64"):
        envelope(prompt_buckets=(64, 96))
    with pytest.raises(CapacityError, match="ascending"):
        envelope(prompt_buckets=(256, 64))


def test_drafts_need_a_proposal_source():
    with pytest.raises(CapacityError, match="needs a proposal source"):
        envelope(proposal_sources=())


def test_plan_requires_known_dimensions():
    from ignition.recipes import RecipeError

    with pytest.raises(RecipeError, match="--model PATH"):
        plan_capacity(load_recipe("qwen3"))


def test_flare_tiny_catalog_stays_small():
    """Capturing the bundled default must stay quick: tens of programs, even with mixed."""
    recipe = load_recipe("flare-tiny")
    # 16 request slots (issue 22): 38, and 15 state programs (snapshot, restore, init at B = 1..16, issue 21)
    assert len(plan_capacity(recipe).graphs) <= 55
    assert len(plan_capacity(recipe, CapacityOptions(mixed_prefill=True)).graphs) <= 95


# -- properties ------------------------------------------------------------------------------------


@st.composite
def envelopes(draw):
    concurrency = draw(st.integers(1, 64))
    top = 1 << (concurrency - 1).bit_length()
    ladder = [1 << i for i in range(top.bit_length())]
    lower = draw(st.lists(st.sampled_from(ladder[:-1]), max_size=4)) if top > 1 else []
    buckets = tuple(sorted(set(lower) | {top}))
    prompts = tuple(sorted(draw(st.sets(st.integers(1, 64).map(lambda k: 64 * k), min_size=1, max_size=6))))
    capacity = draw(st.integers(1, 16))
    drafts = draw(st.integers(0, capacity - 1))
    r = draw(st.integers(buckets[0] + 1, 4 * top * (drafts + 1)))  # the smallest R that plans
    return CapacityEnvelope(
        request_slots=concurrency, request_buckets=buckets, prompt_buckets=prompts, draft_depth=drafts,
        speculative_token_capacity=r, completion_token_capacity=capacity, mixed=draw(st.booleans()),
        proposal_sources=("copy",),
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(envelopes())
def test_C4_C5_C7_C10_plan_invariants(env):
    graphs = plan_graphs(env)
    assert graphs == plan_graphs(env), "same input, same plan"
    assert len({g.id for g in graphs}) == len(graphs)
    r = env.speculative_token_capacity
    for g in graphs:
        assert g.batch_capacity & (g.batch_capacity - 1) == 0 and g.batch_capacity <= 64, g.id
        assert g.width <= env.completion_token_capacity and g.width <= env.max_width, g.id
        assert g.estimated_duration_ns == 0
        if g.prefill_capacity:
            assert g.prefill_capacity % 64 == 0 and g.prefill_capacity >= g.width, g.id
        if g.kind is GraphKind.SPECULATIVE and g.width > 1:
            assert g.proposal_depth >= 1 and g.value_source is not None, g.id
            if g.ragged:
                assert g.batch_capacity < g.aggregate <= r < g.batch_capacity * g.width, g.id
            else:
                assert g.aggregate == g.batch_capacity * g.width <= r, g.id
        if g.kind is GraphKind.SPECULATIVE and g.width == 1:
            assert g.proposal_depth == 0 and g.speculation_enabled
        if g.kind is GraphKind.MIXED:
            assert mixed_contract_problem(g, env.completion_token_capacity) is None
            assert g.max_packed_tokens == g.prefill_capacity + (g.batch_capacity - 1) * g.width
            if g.width > 1:
                assert g.batch_capacity * g.width <= r
                assert g.prefill_capacity == balanced_prompt_bucket(env.prompt_buckets)


@settings(max_examples=EXAMPLES, deadline=None)
@given(envelopes())
def test_C8_C9_mixed_counts_follow_the_contract(env):
    shapes = mixed_shapes(env)
    mixed_batches = [b for b in env.request_buckets if b >= 2]
    ordinary = [g for g in shapes if not g.speculation_enabled]
    assert len(ordinary) == len(mixed_batches) * len(env.prompt_buckets)
    speculative = [g for g in shapes if g.speculation_enabled]
    if not env.speculative:
        assert not speculative
        return
    wider = sum(1 for b in mixed_batches for w in range(2, env.max_width + 1)
                if b * w <= env.speculative_token_capacity)
    assert len(speculative) == len(ordinary) + wider
    # the chosen bucket is never beaten on the worst multiplicative distance
    t = balanced_prompt_bucket(env.prompt_buckets)
    low, high = env.prompt_buckets[0], env.prompt_buckets[-1]
    assert all(max(t / low, high / t) <= max(u / low, high / u) * (1 + 1e-12) for u in env.prompt_buckets)


@settings(max_examples=EXAMPLES, deadline=None)
@given(envelopes())
def test_C10_plan_max_packed_tokens_is_the_largest_graph_extent(env):
    graphs = plan_graphs(env)
    extents = [g.prefill_capacity + (g.batch_capacity - 1) * g.width if g.kind is GraphKind.MIXED
               else g.prefill_capacity or g.aggregate for g in graphs]
    assert max(g.max_packed_tokens for g in graphs) == max(extents)


def test_state_programs_at_every_request_bucket_only_with_a_checkpoint_store():
    """snapshot, restore and init at B = 1, 2, 4 for concurrency 3; a recipe without checkpoint rows plans none."""
    from ignition.recipes.schema import CheckpointDefaults

    recipe = load_recipe("flare-tiny")
    kept = plan_capacity(dataclasses.replace(recipe, checkpoints=CheckpointDefaults(rows=3)), CapacityOptions(concurrency=3))
    state = [g for g in kept.graphs if g.kind.value in ("snapshot", "restore", "init")]
    assert [(g.kind.value, g.batch_capacity) for g in state] == [
        (kind, b) for kind in ("snapshot", "restore", "init") for b in (1, 2, 4)]
    assert all(g.width == 1 and not g.prefill_capacity and not g.proposal_depth for g in state)
    assert kept.envelope.checkpoint_rows == 3
    bare = plan_capacity(dataclasses.replace(recipe, checkpoints=CheckpointDefaults(rows=0)), CapacityOptions(concurrency=3))
    assert not [g for g in bare.graphs if g.kind.value in ("snapshot", "restore", "init")]
    assert [g.id for g in bare.graphs] == [g.id for g in kept.graphs if g not in state]
