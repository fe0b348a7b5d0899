"""Load-time program selection (spec C6, Y3): ``helios.runtime.engine.select_programs``."""

from __future__ import annotations

import pytest

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from helios.runtime.engine import select_programs

SPEC = GraphKind.SPECULATIVE
CATALOG = (
    GraphDescriptor("prefill_p64", GraphKind.PREFILL, 1, prefill_capacity=64),
    GraphDescriptor("decode_b4", GraphKind.DECODE, 4),
    GraphDescriptor("spec_b4_w1", SPEC, 4, proposal_source="learned", speculation_enabled=True),
    GraphDescriptor("spec_b4_w2", SPEC, 4, 1, 2, value_source=ValueSource.QUERY_LENGTH, proposal_source="learned"),
    GraphDescriptor("spec_b1_w4", SPEC, 1, 3, 4, value_source=ValueSource.QUERY_LENGTH, proposal_source="learned"),
    GraphDescriptor("spec_b4_w4_ql", SPEC, 4, 3, 4, 8, ragged=True, value_source=ValueSource.QUERY_LENGTH,
                    proposal_source="learned"),
    GraphDescriptor("spec_b4_w4_pl", SPEC, 4, 3, 4, 8, ragged=True, value_source=ValueSource.PREFIX_LIMIT,
                    proposal_source="learned", confidence_width=3),
    GraphDescriptor("spec_b4_w4_copy", SPEC, 4, 3, 4, 8, ragged=True, value_source=ValueSource.QUERY_LENGTH,
                    proposal_source="copy"),
    GraphDescriptor("mixed_b2_w1", GraphKind.MIXED, 2, prefill_capacity=64),
    GraphDescriptor("mixed_b2_w1_spec", GraphKind.MIXED, 2, prefill_capacity=64, proposal_source="learned",
                    speculation_enabled=True),
    GraphDescriptor("mixed_b2_w4", GraphKind.MIXED, 2, 3, 4, prefill_capacity=64,
                    value_source=ValueSource.QUERY_LENGTH, proposal_source="learned"),
)


def ids(graphs) -> set[str]:
    return {g.id for g in graphs}


ORDINARY = {"prefill_p64", "decode_b4", "mixed_b2_w1"}


def test_Y3_adaptive_with_the_draft_floor_keeps_every_speculative_program_and_drops_ordinary_generation():
    kept = ids(select_programs(CATALOG, "adaptive", floor="draft"))
    # decode and ordinary mixed would skip draft absorption and leave the draft cache behind
    assert kept == ids(CATALOG) - {"decode_b4", "mixed_b2_w1"}


def test_adaptive_with_the_plain_floor_keeps_ordinary_generation_beside_the_draft_keeping_twins():
    """The departure (docs/scheduling-utility.md): the scheduler chooses plain or draft-keeping width one
    by measured cost, and stops offering learned rounds to a row an ordinary frame ran."""
    assert select_programs(CATALOG, "adaptive") == CATALOG  # the default floor
    assert ids(select_programs(CATALOG, "adaptive", 2, floor="plain")) == {
        "prefill_p64", "decode_b4", "spec_b4_w1", "spec_b4_w2", "mixed_b2_w1", "mixed_b2_w1_spec"}


@pytest.mark.parametrize("floor", ["plain", "draft"])
def test_the_floor_changes_only_adaptive(floor):
    assert ids(select_programs(CATALOG, "off", floor=floor)) == ORDINARY
    assert ids(select_programs(CATALOG, "fixed", 2, floor=floor)) == {"prefill_p64", "spec_b4_w2"}


def test_an_unknown_floor_is_refused():
    with pytest.raises(ValueError, match="adaptive floor must be one of plain, draft"):
        select_programs(CATALOG, "adaptive", floor="lazy")
    from helios.runtime.engine import EngineConfig
    with pytest.raises(ValueError, match="adaptive_floor must be one of plain, draft"):
        EngineConfig(adaptive_floor="lazy")


@pytest.mark.parametrize("mode, width", [("off", None), ("adaptive", 1), ("fixed", 1)])
def test_Y3_zero_drafts_selects_the_ordinary_catalog(mode, width):
    assert ids(select_programs(CATALOG, mode, width)) == ORDINARY


def test_Y3_a_catalog_without_speculative_programs_serves_ordinary_programs_in_every_mode():
    ordinary = tuple(g for g in CATALOG if g.id in ORDINARY)
    for mode in ("off", "fixed", "adaptive"):
        assert select_programs(ordinary, mode) == ordinary


def test_Y3_a_copy_only_catalog_keeps_ordinary_decoding_beside_its_copy_rounds():
    copy_only = tuple(g for g in CATALOG if g.proposal_source in (None, "copy"))
    assert ids(select_programs(copy_only, "adaptive")) == ORDINARY | {"spec_b4_w4_copy"}


def test_C6_fixed_defaults_to_the_widest_width_keeps_host_allocated_ragged_and_drops_device_allocation():
    kept = ids(select_programs(CATALOG, "fixed"))
    assert "spec_b4_w4_ql" in kept and "spec_b4_w4_pl" not in kept
    assert kept == {"prefill_p64", "spec_b1_w4", "spec_b4_w4_ql", "spec_b4_w4_copy", "mixed_b2_w4"}


def test_C6_fixed_at_a_chosen_width_keeps_exactly_that_verification_width():
    kept = select_programs(CATALOG, "fixed", 2)
    assert ids(kept) == {"prefill_p64", "spec_b4_w2"}  # no width-one rounds, mixed or separate
    assert {g.width for g in kept if g.kind is not GraphKind.PREFILL} == {2}


def test_C6_a_width_only_removes_wider_programs_speculative_and_mixed_alike():
    kept = select_programs(CATALOG, "adaptive", 2, floor="draft")
    assert ids(kept) == {"prefill_p64", "spec_b4_w1", "spec_b4_w2", "mixed_b2_w1_spec"}
    assert all(g.width <= 2 for g in kept)


@pytest.mark.parametrize("mode", ["adaptive", "fixed"])
@pytest.mark.parametrize("width", [3, 5])
def test_C6_a_width_no_program_has_is_refused_naming_the_widths_there_are(mode, width):
    with pytest.raises(ValueError, match=rf"no speculative program of width {width}.*widths are 1, 2, 4"):
        select_programs(CATALOG, mode, width)


def test_C6_fixed_refuses_a_width_only_device_allocated_programs_have():
    only_pl_at_4 = tuple(g for g in CATALOG if g.id not in ("spec_b1_w4", "spec_b4_w4_ql", "spec_b4_w4_copy", "mixed_b2_w4"))
    with pytest.raises(ValueError, match="fixed speculation needs host-allocated programs of width 4; .* widths 2"):
        select_programs(only_pl_at_4, "fixed", 4)
    assert ids(select_programs(only_pl_at_4, "fixed")) == {"prefill_p64", "spec_b4_w2"}  # the widest fixed can run
    assert "spec_b4_w4_pl" in ids(select_programs(only_pl_at_4, "adaptive", 4))
