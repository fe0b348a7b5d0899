"""Back-pressure at the HTTP layer (issue 17, part 4), over a fake engine.

A full waiting line (``EngineOverloaded``) and a queue timeout (``QueueTimeout``)
are 503s in OpenAI's error shape with ``Retry-After``, counted in /metrics.

The engine-side limits themselves (the line's bound, the timeout) are tested
on the real engine in tests/helios/test_admission_limits.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import FakeEngine
from helios.engine_api import EngineOverloaded, EngineStats, GenerationRequest, QueueTimeout, TextDelta
from helios.server.app import ServerConfig
from helios.server.serve import DrainingServer, uvicorn_server

CONTEXT = 128
SAFETY_S = 10.0


class LoadedEngine(FakeEngine):
    """A fake whose waiting line is full for prompts starting with ``!full``, and that times out
    prompts starting with ``!wait`` as if they never got a slot."""

    def __init__(self) -> None:
        super().__init__(context_length=CONTEXT)

    def submit(self, request: GenerationRequest):
        if bytes(request.prompt_token_ids).startswith(b"!full"):
            raise EngineOverloaded("4 requests are already waiting for a slot", retry_after_s=2)
        if bytes(request.prompt_token_ids).startswith(b"!wait"):
            self.submitted.append(request)
            return self._never_admitted()
        return super().submit(request)

    async def _never_admitted(self):
        await asyncio.sleep(0.01)  # the engine's --queue-timeout, as short as a test wants it
        raise QueueTimeout("the request waited 0.01 s for a free slot and never started", retry_after_s=3)
        yield TextDelta("")  # an async generator that never yields


@dataclass
class Running:
    url: str
    port: int
    engine: LoadedEngine
    server: DrainingServer


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    engine = LoadedEngine()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn_server(engine, ServerConfig(), log_level="warning", grace_s=0.2)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    port = sock.getsockname()[1]
    yield Running(f"http://127.0.0.1:{port}", port, engine, server)
    server.should_exit = True
    thread.join(10)
    assert not thread.is_alive(), "uvicorn did not shut down"
    sock.close()


def _completion(prompt, **extra) -> dict:
    return {"model": "fake-model", "prompt": prompt, **extra}


def _samples(url: str, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{url}/metrics").text
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


# ---------------------------------------------------------------- overload


def test_a_full_waiting_line_is_a_503_with_retry_after_in_the_error_shape(served):
    before = _samples(served.url, "flare_requests_total").get((("endpoint", "completions"), ("outcome", "unavailable")), 0)
    response = httpx.post(f"{served.url}/v1/completions", json=_completion("!full please", max_tokens=4))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "unavailable"
    assert "already waiting for a slot" in error["message"]
    after = _samples(served.url, "flare_requests_total")[(("endpoint", "completions"), ("outcome", "unavailable"))]
    assert after == before + 1


def test_a_request_that_never_got_a_slot_is_a_503_queue_timeout(served):
    response = httpx.post(f"{served.url}/v1/completions", json=_completion("!wait for it", max_tokens=4))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"
    error = response.json()["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "service_unavailable"
    assert "never started" in error["message"]


def test_a_streamed_request_that_never_got_a_slot_ends_with_a_queue_timeout_event(served):
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=SAFETY_S,
                      json=_completion("!wait", max_tokens=4, stream=True)) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "queue_timeout" and "never started" in error["message"]


def test_shed_requests_are_counted_in_metrics(served):
    served.engine.base_stats = EngineStats(shed_waiting_full=7, shed_queue_timeout=2)
    try:
        shed = _samples(served.url, "flare_requests_shed_total")
    finally:
        served.engine.base_stats = EngineStats()
    assert shed == {(("reason", "waiting_full"),): 7.0, (("reason", "queue_timeout"),): 2.0}
