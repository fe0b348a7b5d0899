"""``PolicyConfig.prefill_defers_decode``: a program that leaves decoders waiting is scored with their round.

docs/scheduling-utility.md, "Departures from the spec" (3). Fifteen decoders worth 140 each, one
256-token prompt worth 62 per token; the example catalog's durations: ``prefill t256`` 5.84 ms,
``decode b16`` 3.78 ms, ``mixed b16 t256`` 7.62 ms (the chunk and the fifteen decoders in one frame).
"""

from __future__ import annotations

import pytest
from sched_harness import decode, mixed, prefill

from helios.scheduler import GraphKind, PolicyConfig
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Population
from tests.helios.scheduler.test_policy import decoders, prompters, timing

P256, D16, D8, M16 = prefill(256), decode(16), decode(8), mixed(16, 256)
LANE, PRICE, ROWS = 140.0, 62.0, 15
PROMPT = 256 * PRICE
DECODERS = ROWS * LANE


def choose(graphs_ms: dict, defers: bool, rows: int = ROWS, prompt: bool = True):
    graphs = list(graphs_ms)
    population = Population(decoders([LANE] * rows), prompters([256] if prompt else [], price=PRICE), 0.0,
                            defers_decode=defers)
    return select(graphs, [timing(graphs_ms[g]) for g in graphs], population)


def test_spec_rate_sends_the_chunk_alone_and_the_deferral_charge_sends_it_beside_the_decoders():
    catalog = {P256: 5.84, D16: 3.78, M16: 7.62}
    alone = choose(catalog, defers=False)
    assert alone.graph == P256 and alone.score == pytest.approx(PROMPT / 5.84)
    # the chunk alone is scored with the decoders' own round after it: (N_P + N_D) / (T_P + T_D)
    # = 1868 value/ms, below the mixed frame's 2358, which does the same work 2 ms sooner
    beside = choose(catalog, defers=True)
    assert beside.graph == M16 and beside.score == pytest.approx((PROMPT + DECODERS) / 7.62)
    assert (PROMPT + DECODERS) / (5.84 + 3.78) < beside.score


def test_deferral_charge_keeps_the_order_of_a_prefill_and_the_decode_round_it_defers():
    # no mixed program: the prefill is worth more per ms than the round, so it still goes first
    # (the pair's rate lies between the two), scored over the pair
    choice = choose({P256: 5.84, D16: 3.78}, defers=True)
    assert choice.graph == P256
    assert choice.score == pytest.approx((PROMPT + DECODERS) / (5.84 + 3.78))


def test_deferral_charge_prefers_one_full_batch_to_a_partial_one_and_its_remainder():
    # ten decoders, no prompt: b8 serves eight at 8 * 140 / 3.14 = 357 value/ms against b16's
    # 10 * 140 / 3.78 = 370 -- close, so make b8 faster: 2.6 ms (431 value/ms) wins on its own rate
    catalog = {D8: 2.6, D16: 3.78}
    assert choose(catalog, defers=False, rows=10, prompt=False).graph == D8
    # charged the round of the two it leaves out (b8 again, 2.6 ms): 10 * 140 / 5.2 = 269 < 370
    full = choose(catalog, defers=True, rows=10, prompt=False)
    assert full.graph == D16 and full.score == pytest.approx(10 * LANE / 3.78)
    assert full.graph.kind is GraphKind.DECODE


def test_prefill_defers_decode_is_a_choice_field_and_the_throughput_preset_drops_it():
    assert PolicyConfig().prefill_defers_decode == 0  # the spec's own rate is the default (see the docs)
    assert PolicyConfig.preset("throughput").prefill_defers_decode == 0
    with pytest.raises(ValueError):
        PolicyConfig(prefill_defers_decode=2)
