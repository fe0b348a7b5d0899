"""vLLM's utility routes (/tokenize, /detokenize, /version), cached-token usage, the latency and token
histograms on /metrics, the access log and the periodic stats line (issue 18, items 7 and 8).

Real uvicorn on loopback over the fake engine (fake_engine.py), real clients
(openai where it has a method for the route, httpx otherwise).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from fake_engine import EOS, ByteTokenizer, FakeEngine
from server_process import serving_in_thread, wait_until
from helios import cli, launch
from helios.runtime.engine_api import EngineStats, ExecutionTotals, SpeculativeTotals
from helios.launch import LaunchError, RunOptions
from helios.server.app import ServerConfig
from helios.server.serve import uvicorn_server
from helios.server.stats_log import StatsSample, stats_line

MODEL = "fake-model"
API_KEY = "observability-key"
BOS = EOS  # the fake vocabulary's one special token stands in for a BOS
REPO = Path(__file__).resolve().parents[2]


class BosTokenizer(ByteTokenizer):
    """Bytes, plus a leading special token when ``add_special_tokens`` asks for one (as Llama's BOS)."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return ([BOS] if add_special_tokens else []) + super().encode(text, add_special_tokens=False)


class BosEngine(FakeEngine):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tokenizer = BosTokenizer()


@dataclass
class Running:
    url: str
    engine: FakeEngine

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, **kwargs)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=10.0)


def _serve(engine: FakeEngine, config: ServerConfig = ServerConfig(), grace_s: float = 1.0) -> Iterator[Running]:
    with serving_in_thread(uvicorn_server(engine, config, log_level="warning", grace_s=grace_s)) as url:
        yield Running(url, engine)


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    yield from _serve(BosEngine(context_length=128))


@pytest.fixture(scope="module")
def logged() -> Iterator[Running]:
    yield from _serve(FakeEngine(context_length=128), ServerConfig(log_requests=True))


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ---------------------------------------------------------------- /tokenize, /detokenize, /version


def test_tokenize_a_prompt_gives_the_ids_a_completion_submits(served):
    with served.client() as client:
        answer = client.post("/tokenize", json={"model": MODEL, "prompt": "héllo"}).json()
    completion = served.openai().completions.create(model=MODEL, prompt="héllo", max_tokens=2)
    assert answer == {"tokens": [BOS, *"héllo".encode()], "count": 7, "max_model_len": 128}
    assert completion.usage.prompt_tokens == answer["count"]
    assert list(served.engine.submitted[-1].prompt_token_ids) == answer["tokens"]


def test_tokenize_honours_add_special_tokens_with_vllms_defaults_per_kind(served):
    messages = [{"role": "user", "content": "hi"}]
    rendered = list(b"[user] hi\n[assistant] ")
    with served.client() as client:
        plain = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
        chat = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
        chat_bos = client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()
    assert plain["tokens"] == list(b"hi")
    assert chat["tokens"] == rendered  # the chat default adds nothing: the template holds what it needs
    assert chat_bos["tokens"] == [BOS, *rendered]
    reply = served.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": MODEL}, 400, "prompt", "missing_field"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt", "invalid_value"),
    ({"prompt": 5}, 400, "prompt", "invalid_value"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "b"}]}, 400, "messages.0.role", "invalid_value"),
    ({"prompt": "a", "return_token_strs": True}, 400, "return_token_strs", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "b"}], "tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}, 400, "continue_final_message", "unsupported_parameter"),
    ({"model": "other", "prompt": "a"}, 404, "model", "model_not_found"),
])
def test_tokenize_refuses_bad_bodies_in_the_openai_error_shape(served, body, status, param, code):
    with served.client() as client:
        error = _error(client.post("/tokenize", json=body), status)
    assert (error["param"], error["code"]) == (param, code)


def test_tokenize_refuses_text_that_is_not_json(served):
    with served.client() as client:
        error = _error(client.post("/tokenize", content=b"{nope"), 400)
    assert error["code"] == "invalid_json"


def test_detokenize_inverts_tokenize(served):
    with served.client() as client:
        ids = client.post("/tokenize", json={"prompt": "naïve", "add_special_tokens": False}).json()["tokens"]
        answer = client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert answer == {"prompt": "naïve"}


@pytest.mark.parametrize("tokens, message", [([104, 257], "257"), ([-1], "-1"), ([10**30], str(10**30))])
def test_detokenize_refuses_ids_outside_the_vocabulary(served, tokens, message):
    with served.client() as client:
        error = _error(client.post("/detokenize", json={"model": MODEL, "tokens": tokens}), 400)
    assert error["param"] == "tokens" and error["code"] == "invalid_value" and message in error["message"]
    assert "[0, 257)" in error["message"]


@pytest.mark.parametrize("body, param, code", [
    ({"model": MODEL}, "tokens", "missing_field"),
    ({"tokens": "abc"}, "tokens", "invalid_value"),
    ({"tokens": [1, True]}, "tokens.1", "invalid_value"),
])
def test_detokenize_refuses_bad_bodies(served, body, param, code):
    with served.client() as client:
        error = _error(client.post("/detokenize", json=body), 400)
    assert (error["param"], error["code"]) == (param, code)


def test_version_is_the_installed_flare_version(served):
    with served.client() as client:
        assert client.get("/version").json() == {"version": metadata.version("flare")}


def test_models_by_id_answers_the_served_model_and_404_otherwise(served):
    card = served.openai().models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "flare"
    with pytest.raises(openai.NotFoundError):
        served.openai().models.retrieve("another-model")


def test_the_utility_routes_need_the_api_key_like_the_others():
    for running in _serve(FakeEngine(), ServerConfig(api_key=API_KEY)):
        good = {"Authorization": f"Bearer {API_KEY}"}
        with running.client() as client:
            for method, path, body in (("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [97]}),
                                       ("GET", "/version", None)):
                assert _error(client.request(method, path, json=body), 401)["code"] == "invalid_api_key"
                assert client.request(method, path, json=body, headers=good).status_code == 200


# ---------------------------------------------------------------- usage.prompt_tokens_details


def test_usage_reports_zero_cached_tokens_whole_and_streamed(served):
    client = served.openai()
    completion = client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=2)
    streamed = [c for c in client.completions.create(model=MODEL, prompt="abc", max_tokens=2, stream=True,
                                                     stream_options={"include_usage": True}) if c.usage]
    chat_streamed = [c for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}) if c.usage]
    for usage in (completion.usage, chat.usage, streamed[-1].usage, chat_streamed[-1].usage):
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0


# ---------------------------------------------------------------- /metrics


def _scrape(running: Running) -> dict:
    with running.client() as client:
        text = client.get("/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict, sample: str, **labels) -> float:
    family = families[re.sub(r"_(total|count|sum|bucket)$", "", sample)]
    return sum(s.value for s in family.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


PHASES = ("flare_e2e_request_latency_seconds", "flare_request_queue_time_seconds",
          "flare_request_prefill_time_seconds", "flare_request_decode_time_seconds")


def test_every_family_carries_the_model_name(served):
    served.engine.base_stats = EngineStats(executions=(ExecutionTotals("decode", "ordinary", 1, 500),),
                                           speculative=(SpeculativeTotals("learned", 1, 3, 2, 3, (1, 1)),))
    try:
        served.openai().completions.create(model=MODEL, prompt="hey", max_tokens=2)
        families = _scrape(served)
    finally:
        served.engine.base_stats = EngineStats()
    flare = [f for name, f in families.items() if name.startswith("flare_")]
    assert {"flare_requests_running", "flare_speculative_accepted_tokens", *PHASES} <= {f.name for f in flare}
    for family in flare:
        assert family.samples and all(s.labels.get("model_name") == MODEL for s in family.samples), family.name


def test_a_finished_request_is_observed_once_in_each_phase_and_token_histogram(served):
    before = _scrape(served)
    served.openai().completions.create(model=MODEL, prompt="hello", max_tokens=3)  # 6 prompt ids (BOS), 3 out
    after = _scrape(served)

    def delta(sample):
        return _value(after, sample, model_name=MODEL) - _value(before, sample, model_name=MODEL)

    for phase in PHASES:
        assert delta(phase + "_count") == 1, phase
        assert after[phase].type == "histogram"
    assert delta("flare_request_prompt_tokens_count") == 1 and delta("flare_request_prompt_tokens_sum") == 6
    assert delta("flare_request_generation_tokens_sum") == 3
    # the phases split the request's latency at the hand-off and the first token
    parts = sum(delta(p + "_sum") for p in PHASES[1:])
    assert parts == pytest.approx(delta(PHASES[0] + "_sum"), rel=1e-6, abs=1e-6)


def test_refused_requests_are_in_no_latency_histogram(served):
    before = _scrape(served)
    with served.client() as client:
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 9}).status_code == 400
    after = _scrape(served)
    assert all(_value(after, p + "_count") == _value(before, p + "_count") for p in PHASES)


def test_preemptions_are_zero_and_client_aborts_are_counted():
    for running in _serve(FakeEngine(context_length=4096, token_delay_s=0.02), grace_s=0.2):
        with running.client() as client, client.stream(
                "POST", "/v1/completions", json={"model": MODEL, "prompt": "w" * 200, "max_tokens": 200, "stream": True}) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
        wait_until(lambda: _value(_scrape(running), "flare_request_aborts_total", reason="client_gone") == 1, "the abort")
        families = _scrape(running)
        assert _value(families, "flare_num_preemptions_total", model_name=MODEL) == 0
        assert _value(families, "flare_request_aborts_total", reason="shutdown_drain") == 0
        assert _value(families, "flare_e2e_request_latency_seconds_count") == 0  # it never finished


# ---------------------------------------------------------------- access log


def _access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flare.requests"]


def test_each_finished_request_gets_one_access_line(logged, caplog):
    caplog.set_level(logging.INFO, logger="flare.requests")
    done = logged.openai().completions.create(model=MODEL, prompt="hello", max_tokens=2)
    list(logged.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok"}], stream=True))
    lines = _access_lines(caplog)
    assert len(lines) == 2
    assert re.fullmatch(rf"request_id={done.id} endpoint=completions status=200 finish_reason=length prompt_tokens=5 "
                        r"output_tokens=2 ttft_s=\d+\.\d{3} duration_s=\d+\.\d{3}", lines[0]), lines[0]
    assert "endpoint=chat status=200 finish_reason=stop" in lines[1]


def test_refused_and_failed_requests_are_logged_with_their_status(logged, caplog):
    caplog.set_level(logging.INFO, logger="flare.requests")
    with logged.client() as client:
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 9})
        client.post("/v1/completions", json={"model": MODEL, "prompt": "!fail now"})
    refused, failed = _access_lines(caplog)
    assert "status=400 finish_reason=rejected prompt_tokens=0 output_tokens=0 ttft_s=-" in refused
    assert "status=500 finish_reason=error" in failed and "output_tokens=1" in failed


def test_no_access_lines_unless_asked(served, caplog):
    caplog.set_level(logging.INFO, logger="flare.requests")
    served.openai().completions.create(model=MODEL, prompt="quiet", max_tokens=1)
    assert _access_lines(caplog) == []


# ---------------------------------------------------------------- stats line


def _sample(at_s, generated, drafts=0, accepted=0, prompt=0.0) -> StatsSample:
    return StatsSample(at_s, running=2, waiting=1, pages_used=16, pages_free=48, prompt_tokens=prompt,
                       generation_tokens=generated, draft_tokens=drafts, accepted_tokens=accepted)


def test_the_stats_line_reports_gauges_and_rates_over_the_interval():
    line = stats_line(_sample(100.0, 50, 10, 5, prompt=20), _sample(110.0, 350, 30, 20, prompt=120))
    assert line == ("running: 2 reqs, waiting: 1 reqs, pages used: 25.0% (16 of 64), prompt throughput: 10.0 tokens/s, "
                    "generation throughput: 30.0 tokens/s, speculative acceptance: 75.0% (15 of 20 drafts)")
    assert stats_line(_sample(0.0, 0), _sample(5.0, 0)).endswith("speculative acceptance: -")


def test_the_server_logs_stats_lines_at_the_interval(caplog):
    caplog.set_level(logging.INFO, logger="flare.stats")
    engine = FakeEngine()
    engine.base_stats = EngineStats(kv_pages_used=3, kv_pages_free=1)
    for running in _serve(engine, ServerConfig(log_stats_interval_s=0.05)):
        running.openai().completions.create(model=MODEL, prompt="abc", max_tokens=2)
        wait_until(lambda: any(r.name == "flare.stats" for r in caplog.records), "a stats line")
    line = next(r.getMessage() for r in caplog.records if r.name == "flare.stats")
    assert line.startswith("running: 0 reqs, waiting: 0 reqs, pages used: 75.0% (3 of 4), prompt throughput: ")


def test_no_stats_lines_with_an_interval_of_zero(caplog):
    caplog.set_level(logging.INFO, logger="flare.stats")
    for running in _serve(FakeEngine(), ServerConfig(log_stats_interval_s=0)):
        running.openai().completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert not [r for r in caplog.records if r.name == "flare.stats"]


@pytest.mark.parametrize("interval", [-1.0, float("inf"), float("nan")])
def test_a_bad_stats_interval_is_refused(interval):
    with pytest.raises(ValueError, match="log_stats_interval_s"):
        ServerConfig(log_stats_interval_s=interval)
    with pytest.raises(LaunchError, match="--log-stats-interval must be a finite number of seconds >= 0"):
        RunOptions(log_stats_interval=interval)


# ---------------------------------------------------------------- flare run flags


def test_flare_run_passes_the_logging_flags_through(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(launch, "run", seen.append)
    runner = CliRunner()
    assert runner.invoke(cli.app, ["run", str(tmp_path)]).exit_code == 0
    assert runner.invoke(cli.app, ["run", str(tmp_path), "--disable-log-requests", "--log-stats-interval", "2.5"]).exit_code == 0
    assert [(o.log_requests, o.log_stats_interval) for o in seen] == [(True, 10.0), (False, 2.5)]


def test_a_bad_log_stats_interval_is_one_line_on_stderr_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "helios.cli", "run", str(tmp_path), "--log-stats-interval", "-1"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "--log-stats-interval" in lines[0], result.stderr


def test_flare_run_sends_access_and_stats_lines_to_stdout(capsys):
    launch.route_server_logs_to_stdout()
    try:
        logging.getLogger("flare.requests").info("request_id=x status=200")
        logging.getLogger("flare.stats").info("running: 0 reqs")
        captured = capsys.readouterr()
    finally:
        for name in ("flare.requests", "flare.stats"):
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = [], True
            logger.setLevel(logging.NOTSET)
    assert "flare.requests: request_id=x status=200" in captured.out and "flare.stats: running: 0 reqs" in captured.out
    assert captured.err == ""
