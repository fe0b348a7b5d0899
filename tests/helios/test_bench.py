"""``flare bench``: metric math on hand-made timelines, then whole runs against the fake engine over real HTTP.

The checklist names no bench rules; the definitions tested are vLLM's
``bench serve`` ones as docs/cli.md states them. The server side reuses
tests/server/test_http_api.py's uvicorn fixture code and fake engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from fake_engine import FakeEngine  # noqa: E402
from test_http_api import _serve  # noqa: E402

from helios.bench.arrivals import arrival_offsets  # noqa: E402
from helios.bench.client import RequestResult, Target  # noqa: E402
from helios.bench.datasets import BenchRequest, DatasetError, DatasetSpec, LengthRange, load_requests, stdlib_sources  # noqa: E402
from helios.bench.metrics import RequestLatency, Slo, Stream, jain_index, windowed_jain  # noqa: E402
from helios.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from helios.bench.server_metrics import deltas, _flare_samples  # noqa: E402
from helios.bench.summary import stream, summarize, to_json  # noqa: E402
from helios.cli import app  # noqa: E402
from helios.runtime.engine_api import EngineStats, ExecutionTotals, SpeculativeTotals  # noqa: E402
from helios.server.app import ServerConfig  # noqa: E402

TOKEN_DELAY_S = 0.02
FIRST_DELAY_S = 0.15
VLLM_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")] + [
    "request_throughput", "output_throughput", "total_token_throughput", "completed", "duration"]


# ---------------------------------------------------------------- pure metric math


def _result(sent: float, chunks: list[float], tokens: int | None = None, chars: list[int] | None = None,
            error: str | None = None) -> RequestResult:
    request = BenchRequest("p", None, 8, 1)
    return RequestResult(request, sent, list(chunks), chars or [1] * len(chunks), 1, tokens, error)


def test_latency_follows_vllm_definitions_on_a_hand_made_timeline():
    # sent at 1.0 s; chunks at 1.1, 1.15, 1.35: TTFT 100 ms, gaps 50 and 200, E2EL 350, 5 tokens (a burst carried 3)
    lat = RequestLatency.of(1.0, [1.1, 1.15, 1.35], 5, 1e-3)
    assert lat.ttft_ms == pytest.approx(100.0) and lat.e2el_ms == pytest.approx(350.0)
    assert lat.itl_ms == pytest.approx((50.0, 200.0))
    assert lat.tpot_ms == pytest.approx(250.0 / 4)  # (E2EL - TTFT) / (tokens - 1): usage tokens, not chunks
    assert RequestLatency.of(0.0, [0.2], 1, 1e-3).tpot_ms is None


def test_goodput_counts_exactly_the_requests_meeting_every_slo():
    results = [
        _result(0.0, [0.1, 0.2, 0.3], tokens=3),  # ttft 100, tpot 100, e2el 300
        _result(0.0, [0.3, 0.35], tokens=2),  # ttft 300 misses ttft 200
        _result(0.0, [0.05, 0.5], tokens=2),  # tpot 450 misses tpot 200
        _result(0.0, [0.15], tokens=1),  # one token: tpot counts as 0, meets all
        _result(0.0, [0.1, 0.2], tokens=2, error="HTTP 500: boom"),  # failed: never good
    ]
    summary = summarize(results, 2.0, Slo(ttft_ms=200, tpot_ms=200), 0.1)
    assert summary.completed == 4 and summary.failed == 1
    assert summary.request_goodput == pytest.approx(2 / 2.0)
    assert summarize(results, 2.0, Slo(ttft_ms=200, tpot_ms=200, e2el_ms=200), 0.1).request_goodput == pytest.approx(0.5)
    assert summarize(results, 2.0, Slo(), 0.1).request_goodput is None


def test_summary_pools_itl_and_uses_usage_tokens_for_throughput():
    results = [_result(0.0, [0.1, 0.2, 0.4], tokens=6), _result(0.0, [0.2, 0.3], tokens=None)]
    summary = summarize(results, 4.0, Slo(), 0.1)
    itl = summary.latencies_ms["itl"]
    assert itl.max == pytest.approx(200.0) and itl.mean == pytest.approx((100 + 200 + 100) / 3)
    assert summary.total_output_tokens == 6 + 2  # the second had no usage: one token per chunk
    assert summary.output_throughput == pytest.approx(8 / 4.0) and summary.request_throughput == pytest.approx(0.5)
    assert summary.latencies_ms["tpot"].median == pytest.approx((60 + 100) / 2)  # (400-100)/(6-1) and (300-200)/(2-1)


def test_jain_index_is_one_for_equal_rates_and_one_over_n_when_one_takes_all():
    assert jain_index([4.0, 4.0, 4.0, 4.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert math.isnan(jain_index([]))


def test_windowed_jain_counts_only_streams_active_through_the_window():
    steady = Stream((0.0, 1.0, 2.0, 3.0, 4.0), (0.0, 1.0, 2.0, 3.0, 4.0))
    twin = Stream((0.0, 1.0, 2.0, 3.0, 4.0), (0.0, 1.0, 2.0, 3.0, 4.0))
    starved = Stream((0.0, 4.0), (0.0, 4.0))  # active throughout, served only at the very end
    assert windowed_jain([steady, twin], 1.0) == pytest.approx(1.0)
    # windows [0,1] [1,2] [2,3]: steady 1, starved 0 -> 1/2; [3,4]: steady 1, starved 4 -> 25/34
    assert windowed_jain([steady, starved], 1.0) == pytest.approx((0.5 * 3 + 25 / 34) / 4)
    late = Stream((2.5, 3.5), (1.0, 2.0))  # never active through a whole window with another: ignored
    assert windowed_jain([steady, late], 1.0) is not None and math.isnan(windowed_jain([late], 1.0))


def test_stream_spreads_usage_tokens_over_chunks_by_text_length():
    # 6 tokens, chunks of 1, 3 and 2 characters: a 3-token speculative burst in the middle
    built = stream(_result(0.0, [1.0, 2.0, 3.0], tokens=6, chars=[1, 3, 2]))
    assert built.cumulative == pytest.approx((1.0, 4.0, 6.0))
    assert built.tokens_by(2.5) == pytest.approx(4.0) and built.tokens_by(0.5) == 0.0


def test_gamma_arrivals_have_the_mean_rate_and_infinite_rate_sends_at_once():
    for burstiness in (0.5, 1.0, 4.0):
        offsets = arrival_offsets(20_001, 8.0, burstiness, np.random.default_rng(1))
        assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
        assert 20_000 / offsets[-1] == pytest.approx(8.0, rel=0.03)
    gaps = np.diff(arrival_offsets(20_001, 8.0, 1.0, np.random.default_rng(2)))
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # Poisson: exponential gaps, CV 1
    bursty = np.diff(arrival_offsets(20_001, 8.0, 0.25, np.random.default_rng(2)))
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 5


def test_server_metric_deltas_by_graph_kind_and_acceptance():
    def exposition(decodes: int, nanos: int, drafts: int, accepted: int) -> str:
        return (
            "# TYPE flare_scheduler_executions_total counter\n"
            f'flare_scheduler_executions_total{{graph_kind="decode",category="ordinary"}} {decodes}\n'
            'flare_scheduler_executions_total{graph_kind="decode",category="discovery"} 2\n'
            "# TYPE flare_scheduler_execution_nanoseconds_total counter\n"
            f'flare_scheduler_execution_nanoseconds_total{{graph_kind="decode",category="ordinary"}} {nanos}\n'
            "# TYPE flare_speculative_draft_tokens_total counter\n"
            f"flare_speculative_draft_tokens_total {drafts}\n"
            "# TYPE flare_speculative_accepted_tokens_total counter\n"
            f"flare_speculative_accepted_tokens_total {accepted}\n"
        )
    change = deltas(_flare_samples(exposition(10, 5_000_000, 40, 10)), _flare_samples(exposition(25, 8_000_000, 100, 40)))
    assert [(r.graph_kind, r.category, r.executions, r.device_ms) for r in change.executions] == [("decode", "ordinary", 15, 3.0)]
    assert change.speculative["acceptance_rate"] == pytest.approx(30 / 60)
    assert deltas(None, _flare_samples(exposition(1, 1, 1, 1))) is None  # no /metrics before: section omitted


# ---------------------------------------------------------------- datasets and flags


def test_length_range_parses_and_rejects():
    assert LengthRange.parse("5:9", "--input-len") == LengthRange(5, 9)
    assert LengthRange.parse("7", "--input-len") == LengthRange(7, 7)
    for bad in ("9:5", "0:3", "a:b", "1:2:3", ""):
        with pytest.raises(DatasetError, match="--input-len"):
            LengthRange.parse(bad, "--input-len")


def test_datasets_random_python_files_and_jsonl(tmp_path):
    spec = DatasetSpec("random", 20, LengthRange(3, 6), LengthRange(4, 4), seed=5)
    randoms = load_requests(spec)
    assert len(randoms) == 20 and all(3 <= len(r.prompt.split()) <= 6 and r.output_len == 4 for r in randoms)
    assert load_requests(spec) == randoms  # seeded
    files = load_requests(dataclasses.replace(spec, name="python-files", count=4, input_len=LengthRange(50, 50)))
    names = {path.name for path in stdlib_sources()}
    assert all(r.prompt.split("\n")[0].removeprefix("# ") in names for r in files)
    jsonl = tmp_path / "set.jsonl"
    jsonl.write_text('{"prompt": "abc", "output_len": 3}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    loaded = load_requests(dataclasses.replace(spec, name=str(jsonl), count=3))
    assert [r.output_len for r in loaded] == [3, loaded[1].output_len, 3] and loaded[1].messages is not None
    jsonl.write_text('{"prompt": "abc", "output_len": -1}\n')
    with pytest.raises(DatasetError, match="line 1: 'output_len'"):
        load_requests(dataclasses.replace(spec, name=str(jsonl)))


# ---------------------------------------------------------------- whole runs over HTTP


@pytest.fixture(scope="module")
def slow_server():
    engine = FakeEngine(context_length=4096, token_delay_s=TOKEN_DELAY_S)
    engine.first_token_delay_s = FIRST_DELAY_S
    yield from _serve(engine, ServerConfig(), grace_s=0.2)


def _config(url: str, count: int = 6, **extra) -> BenchConfig:
    dataset = DatasetSpec("random", count, LengthRange(20, 30), LengthRange(8, 8), seed=3)
    return BenchConfig(Target(url, extra.pop("endpoint", "completions"), ""), dataset, **extra)


def test_run_against_the_fake_engine_times_the_right_chunks(slow_server):
    run = run_benchmark(_config(slow_server.url, max_concurrency=3, slo=Slo(ttft_ms=60_000), fairness_window_s=0.05))
    summary = run.summary
    assert run.model == "fake-model" and summary.completed == 6 and summary.failed == 0
    assert summary.total_output_tokens == 6 * 8  # usage: max_tokens cuts the echo
    assert all(len(r.chunk_times) == 8 and r.completion_tokens == 8 for r in run.results)
    ttft, itl = summary.latencies_ms["ttft"], summary.latencies_ms["itl"]
    # loose sanity bands on the fake's known sleeps: TTFT holds the first delay plus one token's
    assert ttft.median >= (FIRST_DELAY_S + TOKEN_DELAY_S) * 1000 * 0.95
    assert 0.5 * TOKEN_DELAY_S * 1000 <= itl.median <= 5 * TOKEN_DELAY_S * 1000
    assert len(run.results) * 7 == sum(len(lat) for lat in to_json(summary, run.results)["itls"])
    assert summary.request_goodput == pytest.approx(6 / summary.duration_s)
    assert 0.5 <= summary.jain_fairness_index <= 1.0
    in_flight = [sum(o.sent <= r.sent < o.chunk_times[-1] for o in run.results) for r in run.results]
    assert max(in_flight) == 3  # --max-concurrency 3 of 6 sent at once: a send waits for a slot


def test_chat_endpoint_ignores_the_role_chunk(slow_server):
    run = run_benchmark(_config(slow_server.url, count=2, endpoint="chat"))
    assert run.summary.completed == 2
    assert all(len(r.chunk_times) == 8 for r in run.results)  # content chunks only, the role chunk left out
    assert run.summary.latencies_ms["ttft"].median >= FIRST_DELAY_S * 1000


def test_failed_requests_are_counted_not_raised(slow_server, tmp_path):
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": p, "output_len": 4}) for p in ("hello", "!reject me", "!fail now", "world")))
    dataset = DatasetSpec(str(jsonl), 4, LengthRange(1, 1), LengthRange(1, 1), seed=0)
    run = run_benchmark(BenchConfig(Target(slow_server.url, "completions", "fake-model"), dataset))
    errors = sorted(r.error.split(":")[0] for r in run.results if r.error)
    assert run.summary.completed == 2 and run.summary.failed == 2 and errors == ["HTTP 400", "stream error"]
    unreachable = run_benchmark(BenchConfig(Target("http://127.0.0.1:9", "completions", "m"), dataset))
    assert unreachable.summary.failed == 4 and unreachable.summary.completed == 0


def test_server_metrics_section_reports_the_run_delta(slow_server):
    engine = slow_server.engine
    engine.base_stats = EngineStats(executions=(ExecutionTotals("decode", "ordinary", 5, 1_000_000),),
                                    speculative=(SpeculativeTotals(draft_tokens=10, accepted_tokens=4),))

    def count_more(result: RequestResult) -> None:  # the engine "executes" while the run goes on
        engine.base_stats = EngineStats(executions=(ExecutionTotals("decode", "ordinary", 12, 4_000_000),),
                                        speculative=(SpeculativeTotals(draft_tokens=30, accepted_tokens=19),))

    try:
        run = run_benchmark(_config(slow_server.url, count=2), count_more)
    finally:
        engine.base_stats = EngineStats()
    server = run.summary.server.to_json()
    assert server["executions"] == [{"graph_kind": "decode", "category": "ordinary", "executions": 7, "device_ms": 3.0}]
    assert server["speculative"]["acceptance_rate"] == pytest.approx(15 / 20)


def test_cli_writes_vllm_keys_and_rejects_bad_flags(slow_server, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--url", slow_server.url, "--num-prompts", "3", "--input-len", "10:12", "--output-len", "4",
            "--request-rate", "50", "--seed", "1", "--json", str(out), "--goodput", "ttft:60000", "e2el:60000"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert set(VLLM_KEYS + ["request_goodput", "jain_fairness_index", "server_metrics"]) <= set(document)
    assert document["completed"] == 3 and document["goodput_slo_ms"] == {"ttft": 60000.0, "e2el": 60000.0}
    assert document["request_goodput"] == pytest.approx(3 / document["duration"])
    for bad, word in ((["--request-rate", "fast"], "--request-rate"), (["--goodput", "ttft:-3"], "--goodput"),
                      (["--input-len", "9:2"], "--input-len"), (["--endpoint", "embed"], "--endpoint"),
                      (["--dataset", str(tmp_path / "none.jsonl")], "--dataset"), (["stray"], "stray")):
        bad_run = CliRunner().invoke(app, ["bench", "--url", slow_server.url, "--num-prompts", "1", *bad])
        assert bad_run.exit_code == 2 and word in bad_run.output and len(bad_run.output.strip().splitlines()) == 1


def test_plot_without_matplotlib_is_one_clear_line(slow_server, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    result = CliRunner().invoke(app, ["bench", "--url", slow_server.url, "--num-prompts", "1", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2 and "pip install" in result.output and len(result.output.strip().splitlines()) == 1


def test_plot_draws_a_png(slow_server, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    result = CliRunner().invoke(app, ["bench", "--url", slow_server.url, "--num-prompts", "2", "--output-len", "3",
                                      "--input-len", "5", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
