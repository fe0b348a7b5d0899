"""Contention as users feel it, on the simulated clock (spec U6, U14, A7; issue 3 "Contention").

1. While a long prompt prefills, streams that are already decoding keep
   receiving output, with every gap below the spec's 150 ms: the scheduler
   interleaves decode rounds (or mixed rounds) with the prompt's chunks
   instead of running the chunks back to back. (On this catalog the
   output-token value alone already favours the decoders: the throughput
   preset, without decode-age price, interleaves too. The price of that is on
   the long prompt, whose ~260 ms of chunks stretch over more than a second.)
2. A short prompt arriving just behind a long one is not starved: it gets its
   first output long before the long prompt finishes prefilling.

Run with ``-s`` to see the gaps each stream experienced.
"""

from __future__ import annotations

from pathlib import Path

from helios.sim.files import load_catalog, parse_trace
from helios.sim.simulator import RequestOutcome, SimulationOptions, SimulationResult, simulate

CATALOG = Path(__file__).resolve().parents[2] / "examples" / "simulation" / "catalog.yaml"
MS = 1_000_000
GAP_MS = 150.0  # the spec's bound on gaps between visible bursts (V3)
FIRST_OUTPUT_MS = 100.0  # the spec's bound on a 64-token prompt's first output (V3)
LONG_PROMPT = 16_384  # eight of the largest (2048-token) prompt chunks, about 260 ms of prefill alone


HORIZON_NS = 3_000 * MS  # long enough for every window these traces look at


def run(trace: dict) -> SimulationResult:
    options = SimulationOptions(until_ns=HORIZON_NS)
    return simulate(load_catalog(CATALOG), parse_trace(trace, "contention"), options)


def gaps_within(outcome: RequestOutcome, start_ns: int, end_ns: int) -> list[float]:
    """Gaps (ms) a stream saw over [start, end], the edges of the window included."""
    times = [start_ns] + [b.time_ns for b in outcome.bursts if start_ns < b.time_ns < end_ns] + [end_ns]
    return [(later - earlier) / MS for earlier, later in zip(times, times[1:])]


def prefill_window(result: SimulationResult, request_id: str) -> tuple[int, int]:
    """From a request's arrival to its first visible output."""
    outcome = result.request(request_id)
    return outcome.arrival_ns, outcome.bursts[0].time_ns


def test_U6_decoding_streams_keep_output_while_a_long_prompt_prefills():
    trace = {
        "seed": 0,
        "requests": [
            *({"id": f"chat-{i}", "prompt_tokens": 64, "max_tokens": 4000, "accepted_drafts": 3} for i in range(4)),
            {"id": "long", "arrival_ms": 50, "prompt_tokens": LONG_PROMPT, "max_tokens": 16, "accepted_drafts": 3},
        ],
    }
    result = run(trace)
    start, end = prefill_window(result, "long")
    print(f"\nlong prompt ({LONG_PROMPT} tokens) prefilled from {start / MS:.1f} to {end / MS:.1f} ms")
    assert result.request("long").bursts, "the long prompt must get through its prefill within the horizon"
    assert (end - start) / MS > 200, "the long prompt must actually occupy the device for a while"
    for i in range(4):
        outcome = result.request(f"chat-{i}")
        assert outcome.finished_ns is None or outcome.finished_ns > end, "streams outlive the prefill"
        gaps = gaps_within(outcome, start, end)
        bursts = len(gaps) - 1
        longest = sorted(gaps, reverse=True)[:5]
        print(f"chat-{i}: {bursts} bursts during the prefill, longest gaps (ms) {[round(g, 1) for g in longest]}")
        assert max(gaps) < GAP_MS, f"chat-{i} waited {max(gaps):.1f} ms for output during the long prefill"
        assert bursts >= (end - start) / MS / GAP_MS, f"chat-{i} got only {bursts} bursts in the window"
    chunks = [p for p in result.plans if "long" in p.cohort and start <= p.start_ns < end]
    print(f"the long prompt ran in {len(chunks)} plans: {sorted({p.graph.id for p in chunks})}")


def test_U13_short_prompt_behind_a_long_one_is_not_starved():
    trace = {
        "seed": 0,
        "requests": [
            {"id": "long", "arrival_ms": 0, "prompt_tokens": LONG_PROMPT, "max_tokens": 16},
            {"id": "short", "arrival_ms": 5, "prompt_tokens": 64, "max_tokens": 16},
        ],
    }
    result = run(trace)
    long_start, long_first = prefill_window(result, "long")
    short = result.request("short")
    print(
        f"\nlong: first output {long_first / MS:.1f} ms; short (arrived 5 ms): first output "
        f"{short.first_output_ms():.1f} ms after arrival, gaps {[round(g, 1) for g in short.gaps_ms()]}"
    )
    assert short.bursts[0].time_ns < long_first, "the short prompt must not wait for the whole long prefill"
    assert max(short.gaps_ms()) < GAP_MS


def test_U13_short_prompt_behind_a_long_one_gets_first_output_within_100ms():
    """The V3 bound for a 64-token prompt's first output (100 ms), here behind a long prompt.

    The spec states it for startup traces; a user sees the same thing here. The
    device is busy with one 33 ms chunk when the short prompt arrives, so the
    bound is reachable with room to spare.
    """
    trace = {
        "seed": 0,
        "requests": [
            {"id": "long", "arrival_ms": 0, "prompt_tokens": LONG_PROMPT, "max_tokens": 16},
            {"id": "short", "arrival_ms": 5, "prompt_tokens": 64, "max_tokens": 16},
        ],
    }
    short = run(trace).request("short")
    assert short.first_output_ms() <= FIRST_OUTPUT_MS, f"first output {short.first_output_ms():.1f} ms after arrival"


BY_VALUE_AND_CADENCE = {"token_rate_by_value": 1, "age_price_by_cadence": 1}


def test_U6_U13_hold_with_x_by_value_and_the_cadence_age_price():
    """The two choices together (docs/scheduling-utility.md, "The age price from first principles"):
    at c = beta / d^2 alone the long prompt crawls in 64-token mixed rows (its x, one for one, says it
    is richly served) and has no output within the horizon; counted by value its price grows while it
    crawls. A short prompt behind the long one still gets its first output within V3's 100 ms only
    because a newcomer starts at a batch-feasible share (by value, a running prompt gets about one
    output-token equivalent per ms; a share of the full batch's rate would rank the newcomer below it).
    """
    streams = {
        "seed": 0,
        "policy": BY_VALUE_AND_CADENCE,
        "requests": [
            *({"id": f"chat-{i}", "prompt_tokens": 64, "max_tokens": 4000, "accepted_drafts": 3} for i in range(4)),
            {"id": "long", "arrival_ms": 50, "prompt_tokens": LONG_PROMPT, "max_tokens": 16, "accepted_drafts": 3},
        ],
    }
    result = run(streams)
    assert result.request("long").bursts, "the long prompt must get through its prefill within the horizon"
    start, end = prefill_window(result, "long")
    for i in range(4):
        assert max(gaps_within(result.request(f"chat-{i}"), start, end)) < GAP_MS
    behind = {
        "seed": 0,
        "policy": BY_VALUE_AND_CADENCE,
        "requests": [
            {"id": "long", "arrival_ms": 0, "prompt_tokens": LONG_PROMPT, "max_tokens": 16},
            {"id": "short", "arrival_ms": 5, "prompt_tokens": 64, "max_tokens": 16},
        ],
    }
    short = run(behind).request("short")
    assert short.first_output_ms() <= FIRST_OUTPUT_MS, f"first output {short.first_output_ms():.1f} ms after arrival"
