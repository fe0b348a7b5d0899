"""Baseline schedulers, their driver, metrics and report (scripts/scheduling_sim, issue 8)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from flare_contract.graphs import GraphKind
from helios.sim.files import (
    FixedAcceptance,
    SampledAcceptance,
    Trace,
    TraceRequest,
    load_catalog,
    load_trace,
    parse_catalog,
)
from helios.scheduler.config import PolicyConfig
from helios.sim.simulator import Burst, RequestOutcome, SimulationResult, simulate
from scripts.scheduling_sim import report
from scripts.scheduling_sim.baselines import DecodeFirst, PrefillFirst, baseline_specs
from scripts.scheduling_sim.driver import DriverError, run
from scripts.scheduling_sim.helios_adapter import HeliosAdapter
from scripts.scheduling_sim.interface import Frame, FrameDone, Lane, LaneResult, Stream
from scripts.scheduling_sim.metrics import Slo, jain_index, measure, request_latency, service_difference, windowed_jain
from scripts.scheduling_sim.queues import FifoQueue, VirtualTokenCounter
from scripts.scheduling_sim.shapes import Shapes
from scripts.scheduling_sim.speculation import FixedLength, GoodputLength, PlainDecode
from scripts.scheduling_sim.workloads import CHAT, Lengths, capacity_rps

MS = 1_000_000
EXAMPLE_CATALOG = "examples/simulation/catalog.yaml"


def tiny_catalog(mixed: bool = True, slots: int = 4):
    graphs = [{"kind": "decode", "batch_capacity": b, "duration_ms": 2.0 + 0.1 * b} for b in (1, 2, 4)]
    graphs += [
        {"kind": "speculative", "batch_capacity": b, "width": w, "duration_ms": 2.0 + 0.5 * (w - 1) + 0.1 * b}
        for b in (1, 2, 4) for w in (2, 3, 4)
    ]
    graphs += [
        {"kind": "prefill", "batch_capacity": 1, "prefill_capacity": t, "duration_ms": 2 + t / 64} for t in (64, 256)
    ]
    if mixed:
        graphs += [
            {"kind": "mixed", "batch_capacity": b, "prefill_capacity": t, "duration_ms": 3 + t / 64}
            for b in (2, 4) for t in (64, 256)
        ]
    return parse_catalog({"request_slots": slots, "graphs": graphs})


def request(name: str, prompt: int, output: int, arrival_ms: float = 0.0, accepted: int = 0) -> TraceRequest:
    return TraceRequest(name, int(arrival_ms * MS), prompt, output, FixedAcceptance(accepted))


def trace(*requests: TraceRequest, seed: int = 0) -> Trace:
    return Trace(PolicyConfig.preset("balanced"), seed, requests)


def decoding(name: str, output: int = 50, client: str = "default") -> Stream:
    """A stream whose prompt is done and that has produced its first token."""
    stream = Stream(request(name, 16, output), client)
    stream.prompt_done, stream.produced = 16, 1
    return stream


def waiting_prompt(name: str, prompt: int, client: str = "default") -> Stream:
    return Stream(request(name, prompt, 20), client)


def admit_all(engine, *streams: Stream) -> None:
    for stream in streams:
        assert engine.admit(stream, 0)


# ---------------------------------------------------------------------------
# Shapes: the smallest captured program that fits
# ---------------------------------------------------------------------------


def test_shapes_pick_the_smallest_fitting_program_padded():
    shapes = Shapes(tiny_catalog())
    assert shapes.decode(3).batch_capacity == 4
    assert shapes.decode(5) is None
    assert shapes.decode(2, width=3).kind is GraphKind.SPECULATIVE and shapes.decode(2, width=3).width == 3
    assert shapes.prefill(65).prefill_capacity == 256
    assert shapes.mixed(decoders=1, tokens=10).batch_capacity == 2
    assert shapes.mixed(decoders=2, tokens=100).batch_capacity == 4 and shapes.mixed(2, 100).prefill_capacity == 256
    assert shapes.speculative_widths() == (2, 3, 4)


def test_shapes_keep_wide_programs_flagged_speculation_enabled_as_the_bundled_capture_writes_them():
    """flare run --dump-estimates of the bundled catalog flags every speculative program; only the
    width-one variants are Helios's mode-switching programs, so fixed-k still finds its widths."""
    graphs = [{"kind": "decode", "batch_capacity": 1, "duration_ms": 2.0},
              {"kind": "speculative", "batch_capacity": 1, "width": 1, "speculation_enabled": True,
               "duration_ms": 1.0},
              {"kind": "speculative", "batch_capacity": 2, "width": 3, "speculation_enabled": True,
               "duration_ms": 3.0}]
    shapes = Shapes(parse_catalog({"request_slots": 2, "graphs": graphs}))
    assert shapes.speculative_widths() == (3,)
    assert shapes.decode(2, width=3).batch_capacity == 2
    assert shapes.decode(1).kind is GraphKind.DECODE  # plain decode is never the width-one variant


# ---------------------------------------------------------------------------
# Baselines' defining behaviour on hand-made situations
# ---------------------------------------------------------------------------


def test_fcfs_prefill_first_runs_a_waiting_prompt_before_the_next_decode_round():
    shapes = Shapes(tiny_catalog())
    fcfs = PrefillFirst("fcfs", shapes, FifoQueue(), PlainDecode())
    a, b, prompt = decoding("a"), decoding("b"), waiting_prompt("p", 200)
    admit_all(fcfs, a, b, prompt)
    frame = fcfs.plan(0)
    assert frame.graph.kind is GraphKind.PREFILL and [lane.stream for lane in frame.lanes] == [prompt]
    assert frame.lanes[0].prompt_tokens == 200 and frame.graph.prefill_capacity == 256  # padded to the bucket
    assert fcfs.plan(0) is None  # one frame in flight
    prompt.prompt_done, prompt.produced = 200, 1
    fcfs.complete(FrameDone(frame, (), 0, 1))
    decode = fcfs.plan(0)
    assert decode.graph.kind is GraphKind.DECODE and {lane.stream.spec.id for lane in decode.lanes} == {"a", "b", "p"}


def test_fcfs_prefill_first_stalls_decoders_on_the_driver_too():
    """End to end: between a prompt's arrival and its first token, the running decoder gets nothing."""
    catalog = tiny_catalog()
    result = run(catalog, trace(request("chat", 16, 40), request("doc", 512, 4, arrival_ms=20)),
                 PrefillFirst("fcfs", Shapes(catalog), FifoQueue(), PlainDecode()))
    doc, chat = result.request("doc"), result.request("chat")
    after = [p for p in result.plans if p.start_ns >= doc.arrival_ns and p.end_ns <= doc.bursts[0].time_ns]
    assert after and all(p.graph.kind is GraphKind.PREFILL and p.cohort == ("doc",) for p in after)
    assert chat.finished_ns > doc.bursts[0].time_ns  # chat was still decoding during the stall


def test_decode_first_takes_every_decoder_then_a_chunk_of_the_remaining_budget():
    shapes = Shapes(tiny_catalog())
    sarathi = DecodeFirst("sarathi", shapes, FifoQueue(), budget=64)
    decoders = [decoding(f"d{i}") for i in range(3)]
    prompt = waiting_prompt("p", 500)
    admit_all(sarathi, *decoders, prompt)
    frame = sarathi.plan(0)
    assert frame.graph.kind is GraphKind.MIXED and frame.graph.batch_capacity == 4
    assert [lane.stream for lane in frame.lanes if not lane.is_prompt] == decoders
    assert frame.prompt_lanes()[0].prompt_tokens == 64 - 3 and frame.graph.prefill_capacity == 64


def test_decode_first_budget_caps_at_the_largest_mixed_chunk_and_never_drops_decoders():
    shapes = Shapes(tiny_catalog())
    wide = DecodeFirst("sarathi", shapes, FifoQueue(), budget=2048)
    tight = DecodeFirst("sarathi", shapes, FifoQueue(), budget=3)
    for engine in (wide, tight):
        admit_all(engine, *(decoding(f"d{i}") for i in range(3)), waiting_prompt("p", 500))
    assert wide.plan(0).prompt_lanes()[0].prompt_tokens == 256
    squeezed = tight.plan(0)  # the budget holds the decoders and nothing more
    assert squeezed.graph.kind is GraphKind.DECODE and len(squeezed.lanes) == 3


def test_decode_first_without_mixed_programs_alternates_decode_and_prefill_frames():
    shapes = Shapes(tiny_catalog(mixed=False))
    sarathi = DecodeFirst("sarathi", shapes, FifoQueue(), budget=128)
    a, prompt = decoding("a"), waiting_prompt("p", 500)
    admit_all(sarathi, a, prompt)
    kinds = []
    for _ in range(4):
        frame = sarathi.plan(0)
        kinds.append(frame.graph.kind)
        if frame.prompt_lanes():
            assert frame.lanes[0].prompt_tokens == 128
        sarathi.complete(FrameDone(frame, (), 0, 1))
    assert kinds == [GraphKind.DECODE, GraphKind.PREFILL] * 2


def test_decode_first_keeps_every_running_decoder_in_every_frame_on_the_driver():
    catalog = tiny_catalog()
    requests = [request(f"s{i}", 16, 60, arrival_ms=i) for i in range(3)] + [request("doc", 900, 4, arrival_ms=30)]
    result = run(catalog, trace(*requests), DecodeFirst("sarathi", Shapes(catalog), FifoQueue(), budget=64))
    for plan in result.plans:
        running = [o.id for o in result.requests if o.bursts and o.bursts[0].time_ns <= plan.start_ns < o.finished_ns]
        assert set(running) <= set(plan.cohort), (plan.start_ns, running, plan.cohort)


def test_vtc_gives_the_free_slot_to_the_client_with_the_smaller_counter():
    vtc = VirtualTokenCounter()
    waiting: list[Stream] = []
    heavy1, light = waiting_prompt("h1", 100, "heavy"), waiting_prompt("l", 10, "light")
    heavy2 = waiting_prompt("h2", 10, "heavy")
    for stream in (heavy1, light, heavy2):
        vtc.enqueue(stream, waiting)
        waiting.append(stream)
    assert vtc.take(waiting) is heavy1  # all counters 0: the earliest wins
    assert vtc.counters["heavy"] == 100  # input weight 1 per prompt token
    assert vtc.take(waiting) is light  # 0 < 100
    vtc.served((LaneResult(Lane(light), tokens=3), LaneResult(Lane(heavy1), tokens=1)))
    assert vtc.counters == {"heavy": 102, "light": 10 + 6}  # output weight 2 per token


def test_vtc_lifts_a_newly_backlogged_client_to_the_smallest_backlogged_counter():
    vtc = VirtualTokenCounter(counters={"a": 500.0, "b": 300.0, "idle": 0.0})
    waiting = [waiting_prompt("a1", 1, "a"), waiting_prompt("b1", 1, "b")]
    newcomer = waiting_prompt("n", 1, "idle")
    vtc.enqueue(newcomer, waiting)
    assert vtc.counters["idle"] == 300.0  # not 0: idling earns no credit


def test_vtc_serves_the_light_client_sooner_than_fcfs_under_a_flood():
    catalog = tiny_catalog(slots=1)
    flood = [request(f"f{i}", 64, 20, arrival_ms=0.1 * i) for i in range(6)]
    light = request("light", 64, 20, arrival_ms=1.0)
    clients = {**{r.id: "flood" for r in flood}, "light": "light"}
    shapes = Shapes(catalog)
    first_token = {}
    for name, queue in (("fcfs", FifoQueue()), ("vtc", VirtualTokenCounter())):
        result = run(catalog, trace(*flood, light), PrefillFirst(name, shapes, queue, PlainDecode()), clients)
        first_token[name] = result.request("light").bursts[0].time_ns
    assert first_token["vtc"] < first_token["fcfs"]


def test_fixed_k_always_runs_the_width_k_plus_one_program():
    catalog = tiny_catalog()
    requests = [request(f"s{i}", 40, 30, arrival_ms=2 * i, accepted=1) for i in range(3)]
    for drafts in (1, 2, 3):
        result = run(catalog, trace(*requests), PrefillFirst("k", Shapes(catalog), FifoQueue(), FixedLength(drafts)))
        decode_plans = [p for p in result.plans if p.graph.kind is not GraphKind.PREFILL]
        assert decode_plans and all(p.graph.kind is GraphKind.SPECULATIVE for p in decode_plans)
        assert {p.graph.width for p in decode_plans} == {drafts + 1}


def test_smartspec_picks_longer_speculation_at_higher_acceptance():
    shapes = Shapes(tiny_catalog())
    streams = [decoding(f"d{i}", output=200) for i in range(2)]
    widths = {}
    for name, accepted in (("low", 0), ("high", 3)):
        chooser = GoodputLength(shapes)
        for _ in range(30):
            chooser.observe((LaneResult(Lane(streams[0], width=4), tokens=accepted + 1, offered=3, accepted=accepted),))
        widths[name] = chooser.width(streams)
    assert widths["low"] == 1 and widths["high"] == 4


def test_smartspec_on_the_driver_speculates_wider_for_the_high_acceptance_trace():
    catalog = tiny_catalog()
    mean_width = {}
    for name, survival in (("low", (0.2, 0.04, 0.008)), ("high", (0.95, 0.9, 0.85))):
        requests = [dataclasses.replace(request(f"s{i}", 40, 60, arrival_ms=i), acceptance=SampledAcceptance(survival))
                    for i in range(3)]
        shapes = Shapes(catalog)
        result = run(catalog, trace(*requests), PrefillFirst("ss", shapes, FifoQueue(), GoodputLength(shapes)))
        widths = [p.graph.width for p in result.plans if p.graph.kind is not GraphKind.PREFILL]
        mean_width[name] = sum(widths) / len(widths)
    assert mean_width["high"] > mean_width["low"] + 1


def test_every_baseline_finishes_the_example_trace():
    catalog = load_catalog(EXAMPLE_CATALOG)
    example = _example_trace_without_preseed()
    shapes = Shapes(catalog)
    for spec in baseline_specs(shapes):
        result = run(catalog, example, spec.build(shapes))
        assert not result.stalled
        assert all(o.tokens == r.max_tokens for o, r in zip(result.requests, _by_arrival(example)))


# ---------------------------------------------------------------------------
# Driver: contract checks and agreement with helios.sim.simulator
# ---------------------------------------------------------------------------


class _Overfull:
    """Asks for a decode program with more lanes than it holds."""

    name = "overfull"

    def __init__(self, shapes: Shapes):
        self.shapes, self.streams, self.sent = shapes, [], False

    def admit(self, stream: Stream, now_ns: int) -> bool:
        self.streams.append(stream)
        return True

    def plan(self, now_ns: int) -> Frame | None:
        if self.sent or len(self.streams) < 3:
            return None
        self.sent = True
        return Frame(self.shapes.prefill(64), tuple(Lane(s, prompt_tokens=8) for s in self.streams))

    def complete(self, done: FrameDone) -> None:
        pass


def test_driver_refuses_a_frame_that_does_not_fit_its_program():
    catalog = tiny_catalog()
    with pytest.raises(DriverError, match="3 lanes exceed B=1"):
        run(catalog, trace(*(request(f"r{i}", 16, 4) for i in range(3))), _Overfull(Shapes(catalog)))


def _example_trace_without_preseed() -> Trace:
    example = load_trace("examples/simulation/trace.yaml")
    return dataclasses.replace(
        example, requests=tuple(dataclasses.replace(r, preseed_acceptance=False) for r in example.requests)
    )


def _by_arrival(t: Trace) -> list[TraceRequest]:
    return sorted(t.requests, key=lambda r: r.arrival_ns)


def test_driver_and_helios_simulator_agree_on_the_example_trace():
    """The real scheduler through this driver and through helios.sim.simulator: same bursts, same plans."""
    catalog = load_catalog(EXAMPLE_CATALOG)
    example = _example_trace_without_preseed()
    reference = simulate(catalog, example)
    ours = run(catalog, example, HeliosAdapter(catalog, example.policy))
    assert [o.bursts for o in ours.requests] == [o.bursts for o in reference.requests]
    assert [o.finished_ns for o in ours.requests] == [o.finished_ns for o in reference.requests]
    assert [(p.graph.id, p.cohort, p.start_ns, p.end_ns) for p in ours.plans] == [
        (p.graph.id, p.cohort, p.start_ns, p.end_ns) for p in reference.plans
    ]
    assert any(p.graph.kind is GraphKind.SPECULATIVE for p in ours.plans)  # acceptance draws were exercised


# ---------------------------------------------------------------------------
# Metrics against hand-computed values
# ---------------------------------------------------------------------------


def outcome(name: str, arrival_ms: float, bursts: list[tuple[float, int]]) -> RequestOutcome:
    result = RequestOutcome(name, int(arrival_ms * MS))
    result.bursts = [Burst(int(t * MS), n) for t, n in bursts]
    result.finished_ns = result.bursts[-1].time_ns
    return result


def test_ttft_tpot_e2el_and_pooled_itl():
    a = outcome("a", 0, [(10, 1), (15, 2), (30, 1)])  # 4 tokens
    b = outcome("b", 5, [(25, 1), (26, 1)])
    lat_a = request_latency(a)
    assert (lat_a.ttft_ms, lat_a.e2el_ms) == (10, 30)
    assert lat_a.tpot_ms == pytest.approx((30 - 10) / 3)
    assert request_latency(outcome("c", 0, [(7, 1)])).tpot_ms is None  # one token: no TPOT
    result = SimulationResult((a, b), (), 30 * MS, False, False)
    t = trace(request("a", 10, 4), request("b", 10, 2, arrival_ms=5))
    metrics = measure(result, t, {}, Slo(ttft_ms=15))
    assert metrics.itl_ms.mean == pytest.approx((5 + 15 + 1) / 3)  # pooled: a's two gaps and b's one
    assert metrics.itl_ms.median == 5
    assert metrics.ttft_ms.mean == pytest.approx((10 + 20) / 2)
    assert metrics.duration_s == pytest.approx(0.030)
    assert metrics.output_throughput == pytest.approx(6 / 0.030)
    assert metrics.request_goodput == pytest.approx(1 / 0.030)  # only a meets TTFT <= 15 ms


def test_jain_index_is_one_for_equal_rates_and_one_over_n_for_one_takes_all():
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / 20)


def test_windowed_jain_over_concurrently_active_streams():
    even = [outcome(n, 0, [(t, 1) for t in range(0, 101, 5)]) for n in ("a", "b")]
    assert windowed_jain(even, 50) == pytest.approx(1.0)
    starved = [outcome("a", 0, [(t, 1) for t in range(0, 101, 5)]), outcome("b", 0, [(0, 1), (101, 1)])]
    assert windowed_jain(starved, 50) == pytest.approx(0.5)  # b is active but gets nothing inside


def test_vtc_service_difference_per_window():
    # Client A gets 10 output tokens per 100 ms window, B gets 5; both stay backlogged (prompts done before 0).
    a = outcome("a", 0, [(0, 1)] + [(t, 1) for t in range(10, 201, 10)])
    b = outcome("b", 0, [(0, 1)] + [(t, 1) for t in range(20, 201, 20)])
    result = SimulationResult((a, b), (), 200 * MS, False, False)
    t = trace(request("a", 7, 21), request("b", 7, 11))
    spreads = service_difference(result, t, {"a": "A", "b": "B"}, window_ms=100)
    assert spreads == pytest.approx([(20 - 10) / 0.1, (20 - 10) / 0.1])  # weight 2 per output token, per second


def test_capacity_follows_the_catalog_durations():
    shapes = Shapes(tiny_catalog(slots=4))
    lengths = Lengths(prompt=(64, 64), output=(11, 11))
    per_request_ms = (2 + 64 / 64) + 10 * (2.4 / 4)  # prefill t64 + 10 tokens at the B=4 decode's per-row cost
    assert capacity_rps(shapes, lengths) == pytest.approx(1000 / per_request_ms)
    assert capacity_rps(Shapes(load_catalog(EXAMPLE_CATALOG)), CHAT) > 0


# ---------------------------------------------------------------------------
# report.py
# ---------------------------------------------------------------------------


def test_report_quick_runs_end_to_end_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: tables only
    assert report.main(["--catalog", EXAMPLE_CATALOG, "--out", str(tmp_path), "--quick"]) == 0
    text = (tmp_path / "report.md").read_text()
    for section in ("steady-50", "steady-120", "long-prompt", "vtc-overload", "spec-low", "spec-high"):
        assert f"## {section}" in text
    for name in ("helios", "fcfs", "sarathi-64", "sarathi-2048", "vtc", "fixed-k1", "fixed-k7", "smartspec"):
        assert f"| {name} |" in text
    assert "Where Helios loses" in text and "## Pareto check" in text
    assert "upper bound (device / slots)" in text and "Upper bound (bounds.py)" in text
    results = json.loads((tmp_path / "results.json").read_text())["workloads"]
    assert results["vtc-overload"]["vtc"][0]["service_difference_max"] >= 0
    assert not math.isnan(results["steady-80"]["helios"][0]["request_throughput"])
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_report_plots_one_png_per_figure(tmp_path):
    pytest.importorskip("matplotlib")
    catalog = load_catalog(EXAMPLE_CATALOG)
    example = _example_trace_without_preseed()
    metrics = measure(simulate(catalog, example), example, {}, Slo())
    table = {"example": {"helios": [metrics], "fcfs": [metrics]}}
    written = report.write_plots(table, tmp_path)
    assert (tmp_path / "ttft_ms_p99.png").exists() and all(p.stat().st_size > 0 for p in written)


@pytest.mark.parametrize("argv, message", [
    (["--catalog", "no/such.yaml", "--out", "x"], "cannot read"),
    (["--catalog", EXAMPLE_CATALOG, "--out", "x", "--goodput", "latency:5"], "expected ttft:MS"),
])
def test_report_bad_input_is_one_clear_error(argv, message, capsys):
    assert report.main(argv) == 2
    assert message in capsys.readouterr().err


def test_decode_first_with_no_decoder_runs_the_chunk_on_a_prefill_program():
    sarathi = DecodeFirst("sarathi", Shapes(tiny_catalog()), FifoQueue(), budget=200)
    admit_all(sarathi, waiting_prompt("p", 500))
    frame = sarathi.plan(0)
    assert frame.graph.kind is GraphKind.PREFILL and frame.lanes[0].prompt_tokens == 200


def test_itl_max_catches_one_stall_that_p99_hides():
    gaps = [(float(t), 1) for t in range(0, 400, 2)] + [(600.0, 1)]  # 199 gaps of 2 ms, one of 202 ms
    result = SimulationResult((outcome("a", 0, gaps),), (), 600 * MS, False, False)
    metrics = measure(result, trace(request("a", 10, len(gaps))), {}, Slo())
    assert metrics.itl_ms.p99 < 10 and metrics.itl_ms.max == 202


def test_report_rerenders_from_its_results_json(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    catalog = load_catalog(EXAMPLE_CATALOG)
    example = _example_trace_without_preseed()
    helios = measure(simulate(catalog, example), example, {}, Slo())
    fcfs = measure(run(catalog, example, baseline_specs(Shapes(catalog))[0].build(Shapes(catalog))), example, {}, Slo())
    table = {"example": {"helios": [helios], "fcfs": [fcfs]}}
    (tmp_path / "results.json").write_text(json.dumps(report.Results("the original command", table).to_json()))
    loaded = report.load_results(tmp_path / "results.json").table
    assert loaded["example"]["fcfs"][0].ttft_ms == fcfs.ttft_ms  # Distribution comes back as itself
    assert loaded["example"]["helios"][0].output_throughput == helios.output_throughput
    out = tmp_path / "again"
    assert report.main(["--from-results", str(tmp_path / "results.json"), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "## Summary" in text and "`the original command`" in text
    assert f"{report._cell(helios.output_throughput)} / {report._cell(fcfs.output_throughput)} (fcfs)" in text


def test_the_driver_follows_an_acceptance_schedule_as_the_helios_simulator_does():
    """All schedulers must see identical work: a trace's mid-stream acceptance change reaches the baselines
    too (the driver once drew from the request's first acceptance model for the whole stream)."""
    from helios.sim.files import AcceptanceChange

    changing = dataclasses.replace(request("s", 16, 50), acceptance=FixedAcceptance(0),
                                   acceptance_schedule=(AcceptanceChange(10, FixedAcceptance(3)),))
    result = run(tiny_catalog(), trace(changing), PrefillFirst("k3", Shapes(tiny_catalog()), FifoQueue(), FixedLength(3)))
    produced, sizes_after = 0, []
    for burst in result.request("s").bursts:
        if produced >= 10:
            sizes_after.append(burst.tokens)
        produced += burst.tokens
    assert produced == 50
    assert sizes_after and all(size == 4 for size in sizes_after[:-1]), sizes_after  # 3 accepted drafts + 1


def _pareto_metrics(tok_s: float, ttft_p99: float, itl_p99: float):
    from scripts.scheduling_sim.metrics import Distribution, Metrics

    def tail(p99: float) -> Distribution:
        return Distribution(p99 / 2, p99 / 2, p99, p99, p99)

    return Metrics(10, 1.0, 10.0, tok_s, 10.0, tail(ttft_p99), tail(1.0), tail(itl_p99), tail(100.0), 1.0,
                   math.nan, math.nan)


def test_pareto_check_names_exactly_the_baselines_at_least_as_good_on_every_figure():
    rows = {
        "helios": [_pareto_metrics(100, 50, 10)],
        "better-everywhere": [_pareto_metrics(110, 40, 9)],
        "equal-but-faster": [_pareto_metrics(100, 50, 8)],  # ties on two figures, better on one: dominates
        "identical": [_pareto_metrics(100, 50, 10)],  # equal on all: not better anywhere, does not dominate
        "trade-off": [_pareto_metrics(120, 60, 5)],  # higher throughput, worse TTFT: does not dominate
        "worse": [_pareto_metrics(90, 70, 12)],
    }
    assert report.dominators(rows) == ["better-everywhere", "equal-but-faster"]
    text = "\n".join(report.pareto({"w": rows, "v": {"helios": rows["helios"], "worse": rows["worse"]}}))
    assert "| w | better-everywhere, equal-but-faster |" in text and "| v | none |" in text
    assert "dominated on 1 of 2 workloads" in text


# ---------------------------------------------------------------------------
# capacity.py (issue 20): capacity under an SLO pair by bisection on the rate
# ---------------------------------------------------------------------------


class _FakeRunner:
    """Meets the SLO exactly up to ``boundary`` load; counts the loads it was asked about."""

    def __init__(self, boundary: float):
        self.boundary, self.cache = boundary, {}

    def outcome(self, load: float):
        from scripts.scheduling_sim.capacity import Outcome

        self.cache[load] = Outcome(1.0 if load <= self.boundary else 1e9, 1.0, True)
        return self.cache[load]


@pytest.mark.parametrize("boundary", [0.05, 0.3, 0.99, 1.0, 1.7, 5.0])
def test_capacity_bisection_lands_within_its_stated_precision_below_the_boundary(boundary):
    from scripts.scheduling_sim.capacity import BISECTIONS, capacity

    found = capacity(_FakeRunner(boundary), ttft_ms=10.0, itl_ms=10.0)
    assert found.load <= boundary < found.load * 2 ** (1 / 2**BISECTIONS) * (1 + 1e-12)
    assert found.runs <= 3 + math.ceil(abs(math.log2(boundary))) + BISECTIONS  # bracket by doubling, then bisect


def test_capacity_reports_the_ends_of_its_range():
    from scripts.scheduling_sim.capacity import HIGHEST_LOAD, capacity

    assert capacity(_FakeRunner(100.0), 10.0, 10.0).load == HIGHEST_LOAD
    assert capacity(_FakeRunner(1e-6), 10.0, 10.0).load == 0.0


def test_scaled_trace_runs_the_same_requests_faster():
    from scripts.scheduling_sim.capacity import scaled

    base = trace(request("a", 10, 4, arrival_ms=0.0), request("b", 10, 4, arrival_ms=30.0))
    fast = scaled(base, 3.0)
    assert [r.arrival_ns for r in fast.requests] == [0, 10 * MS]
    assert [dataclasses.replace(r, arrival_ns=0) for r in fast.requests] == [
        dataclasses.replace(r, arrival_ns=0) for r in base.requests]


def test_capacity_of_a_real_run_meets_its_slo_and_the_next_step_does_not():
    from scripts.scheduling_sim.capacity import Runner, capacity
    from scripts.scheduling_sim.workloads import QUICK, build_workloads

    catalog = load_catalog(EXAMPLE_CATALOG)
    shapes = Shapes(catalog)
    workload = next(w for w in build_workloads(shapes, 0, QUICK) if w.name == "short-chat")
    runner = Runner(catalog, shapes, workload, "fcfs")
    found = capacity(runner, ttft_ms=20.0, itl_ms=8.0)
    assert 0 < found.load < 8
    assert runner.outcome(found.load).meets(20.0, 8.0)
    assert not runner.outcome(min(load for load in runner.cache if load > found.load)).meets(20.0, 8.0)


def test_best_capacity_of_a_group_is_its_best_member_found_with_fewer_runs_than_searching_each():
    from scripts.scheduling_sim.capacity import BISECTIONS, best_capacity, capacity

    boundaries = {"a": 0.2, "b": 1.3, "c": 0.7, "d": 3.1, "e": 0.05}
    group = {name: _FakeRunner(b) for name, b in boundaries.items()}
    found = best_capacity(group, ttft_ms=10.0, itl_ms=10.0)
    assert found.leader == "d"
    assert found.load <= 3.1 < found.load * 2 ** (1 / 2**BISECTIONS) * (1 + 1e-12)
    alone = sum(capacity(_FakeRunner(b), 10.0, 10.0).runs for b in boundaries.values())
    assert found.runs < alone / 2
    nobody = best_capacity({"x": _FakeRunner(1e-6), "y": _FakeRunner(1e-7)}, 10.0, 10.0)
    assert (nobody.load, nobody.leader) == (0.0, None)


def test_best_capacity_answers_from_a_runners_earlier_outcomes_by_monotonicity():
    from scripts.scheduling_sim.capacity import best_capacity

    class Counting(_FakeRunner):
        asked = 0

        def outcome(self, load):
            self.asked += 1
            return super().outcome(load)

    runner = Counting(0.6)
    best_capacity({"one": runner}, 10.0, 10.0)
    runner.asked, first = 0, dict(runner.cache)
    # The interactive pair's search leaves outcomes the relaxed one reads: here the same pair again,
    # whose every load is implied by a cached meet or miss, so nothing is simulated.
    assert best_capacity({"one": runner}, 10.0, 10.0).load == max(l for l, o in first.items() if o.ttft_p99_ms < 10)
    assert runner.asked == 0
    # A member that missed a load the leader met is not asked again at any load.
    low, high = Counting(0.1), Counting(2.0)
    best_capacity({"low": low, "high": high}, 10.0, 10.0)
    assert low.asked == 1


# ---------------------------------------------------------------------------
# bounds.py: capacity no scheduler on the catalog can pass
# ---------------------------------------------------------------------------


def test_bound_prices_are_covered_by_every_allowed_program_and_match_the_example_catalogs_costs():
    from scripts.scheduling_sim import bounds

    catalog = load_catalog(EXAMPLE_CATALOG)
    programs = bounds.itl_feasible(bounds.frames(catalog), itl_ms=2.5 * 3.78)
    work = bounds.demands(trace(request("a", 320, 160), request("b", 128, 64)))
    price = bounds.prices(programs, work)
    zero = FixedAcceptance(0)
    for f in programs:  # dual feasibility: no program does more work than its duration pays for
        assert f.duration_ms >= f.rows * bounds.tokens_per_row(zero, f.width) * price.output_ms[zero] \
            + f.tokens * price.token_ms - 1e-9
    # decode-b16 is the cheapest row (3.78 / 16); mixed-b16-t256 (7.62 ms) carries 15 such rows, and what is
    # left of its duration pays for its 256 prompt tokens
    assert price.output_ms[zero] == pytest.approx(3.78 / 16, rel=1e-3)
    assert price.token_ms == pytest.approx((7.62 - 15 * 3.78 / 16) / 256, rel=1e-3)


def test_itl_bound_keeps_only_the_programs_that_leave_no_gap_over_it():
    from scripts.scheduling_sim import bounds

    programs = bounds.frames(load_catalog(EXAMPLE_CATALOG))
    allowed = bounds.itl_feasible(programs, itl_ms=9.45)
    assert all(f.duration_ms <= 9.45 for f in allowed if f.rows > 0)
    prefill = {f.tokens for f in allowed if f.rows == 0}
    assert prefill == {64, 128, 256}  # t512 (9.68 ms) and above break it; t256 + the 2.58 ms round does not
    assert any(f.rows == 15 and f.tokens == 256 for f in allowed)  # mixed-b16-t256, 7.62 ms


def test_bound_fails_when_more_prompts_than_the_p99_allows_cannot_reach_their_first_token_in_time():
    from scripts.scheduling_sim import bounds

    programs = bounds.frames(load_catalog(EXAMPLE_CATALOG))
    quickest = bounds.prompt_path_ms(programs, 8192)
    assert quickest == pytest.approx(4 * 32.72)  # four prefill-b1-t2048
    many = [request(f"r{i}", 8192, 4, arrival_ms=1000.0 * i) for i in range(10)]
    reqs = bounds.requests(trace(*many), programs)
    assert bounds.allowed_misses(10) == 1
    assert not bounds.feasible(reqs, 1.0, ttft_ms=quickest - 1, slots=16)
    assert bounds.feasible(reqs, 1.0, ttft_ms=quickest + 1, slots=16)
    one = [request("long", 8192, 4)] + [request(f"s{i}", 64, 4, arrival_ms=1000.0 * i + 1) for i in range(9)]
    assert bounds.feasible(bounds.requests(trace(*one), programs), 1.0, ttft_ms=quickest - 1, slots=16)


def test_bound_counts_the_request_slots_a_simultaneous_burst_must_wait_for():
    from scripts.scheduling_sim import bounds

    programs = bounds.frames(tiny_catalog(slots=4))
    burst = [request(f"b{i}", 64, 200) for i in range(8)]  # 8 at once, 4 slots: 4 must wait for a finish
    reqs = bounds.requests(trace(*burst), programs)
    residence = min(r.residence_ms for r in reqs)
    assert residence > 199 * 2.1  # 199 decoded tokens, each at least the one-row round
    assert not bounds.feasible(reqs, 1.0, ttft_ms=residence / 2, slots=4)
    assert bounds.feasible(reqs, 1.0, ttft_ms=residence / 2, slots=8)


def test_bound_is_never_below_a_capacity_a_scheduler_reaches():
    from scripts.scheduling_sim import bounds
    from scripts.scheduling_sim.capacity import Runner, capacity
    from scripts.scheduling_sim.workloads import SHORT_CHAT, poisson_shape

    catalog = dataclasses.replace(load_catalog(EXAMPLE_CATALOG), request_slots=4)  # few slots, so they bind
    shapes = Shapes(catalog)
    workload = poisson_shape(shapes, "short-chat", SHORT_CHAT.shorter_outputs(4), 0.7, 40, 0)
    limit = bounds.capacity_bound(catalog, workload.trace, workload.capacity_rps, workload.load, 20.0, 8.0)
    assert 0 < limit.trace < 8 and limit.device > 0 and limit.slots > 0
    for name in ("fcfs", "sarathi-256", "helios"):
        reached = capacity(Runner(catalog, shapes, workload, name), ttft_ms=20.0, itl_ms=8.0).load
        assert 0 < reached <= limit.trace
