"""``PolicyConfig.prefill_defers_decode``: a program that leaves work waiting is scored with its round.

docs/scheduling-utility.md, "Departures from the spec" (3) and "The deferred round". Fifteen decoders
worth 140 each, one 256-token prompt worth 62 per token; the example catalog's durations: ``prefill
t256`` 5.84 ms, ``decode b16`` 3.78 ms, ``mixed b16 t256`` 7.62 ms (the chunk and the fifteen decoders
in one frame).
"""

from __future__ import annotations

import pytest
from sched_harness import decode, mixed, prefill

from helios.scheduler import GraphKind, PolicyConfig
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Population
from tests.helios.scheduler.test_policy import decoders, prompters, timing

P64, P256, D16, D8, M16, M16_64 = prefill(64), prefill(256), decode(16), decode(8), mixed(16, 256), mixed(16, 64)
LANE, PRICE, ROWS = 140.0, 62.0, 15
PROMPT = 256 * PRICE
DECODERS = ROWS * LANE


def choose(graphs_ms: dict, defers: bool, rows: int = ROWS, prompt: bool = True, price: float = PRICE,
           first_token: float = 0.0):
    graphs = list(graphs_ms)
    prm = prompters([256] if prompt else [], price=price, first_token=first_token)
    population = Population(decoders([LANE] * rows), prm, 0.0, defers_decode=defers)
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


def test_without_a_mixed_program_nothing_is_charged():
    # nothing can carry the chunk beside the decoders: the pair would only reorder prefill sizes, so
    # every program keeps its U6 rate
    choice = choose({P256: 5.84, D16: 3.78}, defers=True)
    assert choice.graph == P256 and choice.score == pytest.approx(PROMPT / 5.84)


def test_a_decode_round_that_leaves_a_cheap_prompt_tail_is_scored_with_the_tail_s_frame():
    # a 256-token tail priced low (x lifted by the chunks before it, one for one): 256 * 1.5 + 70 = 454
    tail = 256 * 1.5 + 70.0
    catalog = {P256: 5.84, D16: 3.78, M16: 7.62}
    # alone the decode round wins (2100 / 3.78 = 556 against (454 + 2100) / 7.62 = 335)
    assert choose(catalog, defers=False, price=1.5, first_token=70.0).graph == D16
    # charged with the prefill frame it leaves for later, 5.84 ms: (2100 + 454) / 9.62 = 265.5 < 335
    both = choose(catalog, defers=True, price=1.5, first_token=70.0)
    assert both.graph == M16 and both.score == pytest.approx((tail + DECODERS) / 7.62)


def test_deferral_charge_prefers_one_full_batch_to_a_partial_one_and_its_remainder():
    # ten decoders, no prompt: b8 serves eight at 8 * 140 / 3.14 = 357 value/ms against b16's
    # 10 * 140 / 3.78 = 370 -- close, so make b8 faster: 2.6 ms (431 value/ms) wins on its own rate
    catalog = {D8: 2.6, D16: 3.78, M16: 7.62}
    assert choose(catalog, defers=False, rows=10, prompt=False).graph == D8
    # charged the round of the two it leaves out (b8 again, 2.6 ms): 10 * 140 / 5.2 = 269 < 370
    full = choose(catalog, defers=True, rows=10, prompt=False)
    assert full.graph == D16 and full.score == pytest.approx(10 * LANE / 3.78)
    assert full.graph.kind is GraphKind.DECODE


def test_prefill_defers_decode_is_a_choice_field_and_the_throughput_preset_drops_it():
    assert PolicyConfig().prefill_defers_decode == 1  # the departure is the default (see the docs)
    assert PolicyConfig.preset("throughput").prefill_defers_decode == 0
    with pytest.raises(ValueError):
        PolicyConfig(prefill_defers_decode=2)


def test_the_pair_counts_the_left_out_decoders_so_a_much_richer_prefill_still_goes_first():
    # a whole 512-token prompt in t512 (9.68 ms) against 256 of it beside the decoders (mixed, 7.55 ms):
    # the pair (31744 + 2100) / 13.46 = 2514 beats the mixed frame's 17972 / 7.55 = 2380; without the
    # decoders' value in the pair (31744 / 13.46 = 2358) the mixed frame would win
    p512 = prefill(512)
    graphs = {p512: 9.68, D16: 3.78, M16: 7.55}
    population = Population(decoders([LANE] * ROWS), prompters([512], price=PRICE), 0.0, defers_decode=True)
    choice = select(list(graphs), [timing(ms) for ms in graphs.values()], population)
    assert choice.graph == p512
    assert choice.score == pytest.approx((512 * PRICE + DECODERS) / (9.68 + 3.78))


# ---------------------------------------------------------------------------
# PolicyConfig.age_price_by_cadence: c >= beta / d^2, d the full-batch cadence (U5 with K = k = slots)
# ---------------------------------------------------------------------------


def test_cadence_age_price_is_beta_over_the_cadence_squared_with_the_policy_c_as_floor():
    from helios.scheduler.utility import decode_age_price
    assert decode_age_price(0.1, 64.0, 3.78) == 64.0 / (3.78 * 3.78)
    assert decode_age_price(0.1, 64.0, 40.0) == 0.1  # 64 / 1600 = 0.04 is below the floor
    assert decode_age_price(0.1, 64.0, None) == 0.1  # no measured cadence


def test_cadence_age_price_reaches_every_decoders_slope_and_the_waiting_cost():
    from sched_harness import Driver, ask, measured
    def decoding(catalog, by_cadence):
        s = measured(catalog, policy=PolicyConfig(age_price_by_cadence=by_cadence))
        d = Driver(s, catalog)
        for _ in range(3):
            d.admit(ask(64, 50))
        d.run(40)
        population = s._population(s.now_ns, s._timings())
        assert len(population.decoders.handle) == 3
        return population

    # a mixed program with a prompt row: the choice applies (its mixed frame is 7.62 ms, slower than
    # D16, so d is still D16's cadence)
    catalog = {P256: 5.84, D8: 3.14, D16: 3.78, M16: 7.62}
    by_policy = {by_cadence: decoding(catalog, by_cadence) for by_cadence in (0, 1)}
    # no frame serves decoders beside a prompt: the choice leaves Y1's c (a cadence-sized c would only
    # make prompts wait, docs/scheduling-utility.md)
    plain = decoding({P256: 5.84, D8: 3.14, D16: 3.78}, 1)
    assert plain.active_age_price == pytest.approx(3 * 0.1)
    c = 64.0 / 3.78 ** 2  # 16 slots in decode b16 every 3.78 ms: d = 16 * 3.78 / 16
    assert by_policy[0].active_age_price == pytest.approx(3 * 0.1)
    assert by_policy[1].active_age_price == pytest.approx(3 * c)
    ratio = [b / a for a, b in zip(by_policy[0].decoders.age_slope, by_policy[1].decoders.age_slope)]
    assert ratio == pytest.approx([c / 0.1] * 3)
