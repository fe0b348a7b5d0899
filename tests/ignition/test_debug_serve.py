"""``ignition debug-serve --direct``: the direct engine serves what Helios serves, over the same HTTP layer.

Runs the cached slice of the bundled catalog (``tests/helios/tiny_catalog.py``)
with eager twins of its programs, as the engine phase tests do.
"""

from __future__ import annotations

import asyncio
import math
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from helios.direct.engine import DirectEngine
from helios.direct.scheduler import DECISIONS_KEPT
from helios.direct.serve import build_app
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import GenerationRequest, SamplingParams
from ignition.cli import app as ignition_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helios"))
from eager_target import assert_same_or_near_tie  # noqa: E402
from server_process import start_server, wait_ready  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ("The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3, 4,")


def greedy_outputs(engine, max_tokens: int) -> list[list[int]]:
    """Token ids of every prompt in ``PROMPTS``, submitted together."""
    async def one(i: int, text: str) -> list[int]:
        ids = tuple(engine.tokenizer.encode(text, add_special_tokens=True))
        return [t async for d in engine.submit(GenerationRequest(f"r{i}", ids, max_tokens, GREEDY)) for t in d.token_ids]

    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i, t) for i, t in enumerate(PROMPTS))), 120)
        finally:
            await engine.stop()
    return asyncio.run(main())


def test_greedy_tokens_equal_helios_whatever_the_scheduler_picks(catalog, eager):
    """The direct scheduler picks other programs and cohorts than Helios, the tokens stay the same."""
    config = EngineConfig(speculation="adaptive", threads=1)
    decisions = []
    direct = DirectEngine(catalog, config, program_for=eager, on_decision=decisions.append)
    reference = HeliosEngine(catalog, config, program_for=eager)
    # other programs and cohorts sum in other orders: the same tokens, up to near-ties of the model
    for text, want, got in zip(PROMPTS, greedy_outputs(reference, 10), greedy_outputs(direct, 10)):
        assert_same_or_near_tie(direct.tokenizer.encode(text, add_special_tokens=True), want, got, what=text[:30])
    kinds = {next(g.kind.value for g in direct.scheduler.graphs if g.id == d.program) for d in decisions}
    assert {"prefill"} < kinds  # prompts were chunked, then decode rounds ran
    assert "mixed" not in kinds  # the direct path never uses mixed programs


def test_debug_state_shows_estimates_requests_and_the_last_100_decisions(catalog, eager):
    lines = []
    engine = DirectEngine(catalog, EngineConfig(speculation="off", threads=1), program_for=eager,
                          on_decision=lambda d: lines.append(d.line()))
    with TestClient(build_app(engine)) as client:
        reply = client.post("/v1/completions", json={"model": engine.model_name, "prompt": PROMPTS[0],
                                                     "max_tokens": 120, "temperature": 0})
        assert reply.status_code == 200, reply.text
        state = client.get("/debug/state").json()
    ran = {line.split()[1] for line in lines}  # every decision, not only the last 100
    programs = {p["id"]: p for p in state["programs"]}
    assert ran <= set(programs)
    for program_id, p in programs.items():
        if program_id in ran:
            assert p["estimate_ns"] > 0 and p["age_ns"] >= 0
        else:  # warm-up calls feed no estimate
            assert p["estimate_ns"] == 0 and p["age_ns"] is None
    assert all(math.isfinite(d["score"]) and d["lanes"] for d in state["decisions"])
    assert len(state["decisions"]) == min(len(lines), DECISIONS_KEPT)
    assert [d["program"] for d in state["decisions"]] == [line.split()[1] for line in lines[-DECISIONS_KEPT:]]
    for d in state["decisions"]:
        if d["program"] == "decode_b1":  # one stream: the wider decode programs only add padding (U12)
            wider = [r for r in d["runners_up"] if r["program"] in ("decode_b2", "decode_b4")]
            assert wider and all(r["padding"] for r in wider)
    for r in state["requests"]:
        assert r["phase"] in ("prompt", "decode") and r["produced"] <= r["max_tokens"]


def test_debug_state_decisions_are_capped_at_100(catalog, eager):
    engine = DirectEngine(catalog, EngineConfig(speculation="off", threads=1), program_for=eager)
    greedy_outputs(engine, 60)  # three prompts, 60 tokens: well over 100 decisions unless EOS comes early
    state = engine.debug_state()
    assert len(state["decisions"]) <= DECISIONS_KEPT
    total_tokens = sum(r["produced"] for r in state["requests"])
    assert len(state["decisions"]) == DECISIONS_KEPT or total_tokens < DECISIONS_KEPT
    # the engine reads estimates through the scheduler's public view, whatever cost model it was given
    measured = {p["id"]: p["estimate_ns"] for p in state["programs"] if p["estimate_ns"] > 0}
    assert measured and engine.learned_durations() == measured


def test_bad_request_gets_the_same_openai_error_as_flare_run(catalog, eager):
    engine = DirectEngine(catalog, EngineConfig(speculation="off", threads=1), program_for=eager)
    with TestClient(build_app(engine)) as client:
        reply = client.post("/v1/completions", json={"model": engine.model_name, "prompt": "hi", "max_tokens": -1})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_tokens"


def test_catalog_that_fails_to_load_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "catalog.yaml").write_text("format_version: [")
    result = CliRunner().invoke(ignition_app, ["debug-serve", "--direct", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(tmp_path) in lines[0]


def test_debug_serve_without_direct_says_what_to_pass(tmp_path):
    result = CliRunner().invoke(ignition_app, ["debug-serve", str(tmp_path)])
    assert result.exit_code == 2 and "--direct" in result.output


@pytest.mark.slow
def test_the_command_serves_over_http_logs_each_decision_and_stops_on_sigterm(catalog, tmp_path):
    folder = catalog.path
    log_path = tmp_path / "server.log"
    process = start_server([sys.executable, "-m", "ignition.cli", "debug-serve", "--direct", str(folder),
                            "--verbose", "--threads", "1"], log_path, cwd=Path(__file__).resolve().parents[2])
    try:
        base = wait_ready(process, log_path, name="debug-serve", timeout_s=180.0)
        reply = httpx.post(f"{base}/v1/completions", json={"model": "flare-tiny", "prompt": PROMPTS[0],
                                                          "max_tokens": 6, "temperature": 0}, timeout=60.0)
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("length", "stop")
        state = httpx.get(f"{base}/debug/state", timeout=10.0).json()
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    logged = [line for line in log_path.read_text().splitlines() if "debug_serve: decision " in line]
    assert len(logged) == len(state["decisions"]) >= 2  # a prefill chunk, then decode rounds
    assert all("score=" in line for line in logged)
    assert code == 0


def test_debug_serve_has_flare_runs_body_cap_and_deadlines(catalog, eager):
    """debug-serve is served under the same HTTP limits as flare run: a body larger than a context-filling
    prompt can need is a 413, and a body that stops arriving is a 408 at the body deadline."""
    from helios.direct.serve import DebugServeOptions, debug_server
    from helios.server.serve import HttpLimits, body_limit
    from server_process import serving_in_thread

    engine = DirectEngine(catalog, EngineConfig(speculation="off", threads=1), program_for=eager)
    cap = body_limit(engine.context_length, engine.tokenizer.max_token_bytes)
    assert cap is not None
    limits = HttpLimits(head_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=5.0, max_head_bytes=4096)
    server = debug_server(DebugServeOptions(catalog.path, port=0), engine, limits, grace_s=0.2)
    with serving_in_thread(server) as url:
        with httpx.Client(base_url=url, timeout=30.0) as client:
            too_big = client.post("/v1/completions", json={"model": "flare-tiny", "prompt": "a" * cap})
            state = client.get("/debug/state")
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30.0) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\":")
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    assert state.status_code == 200  # its own route is still there
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
