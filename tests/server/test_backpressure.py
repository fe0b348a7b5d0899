"""Back-pressure and slow clients at the HTTP layer (issue 17, parts 4 and 5), over fake engines.

- a full waiting line (``EngineOverloaded``) and a queue timeout (``QueueTimeout``)
  are 503s in OpenAI's error shape with ``Retry-After``, counted in /metrics;
- a client that sends nothing, half a head, or less body than it declared
  loses its connection (or gets 408) instead of holding it forever;
- text that cannot fit the context is refused before it is tokenized.

The engine-side limits themselves (the line's bound, the timeout) are tested
on the real engine in tests/helios/test_admission_limits.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import ByteTokenizer, FakeEngine
from server_process import serving_in_thread
from helios.runtime.engine_api import EngineOverloaded, EngineStats, GenerationRequest, QueueTimeout, TextDelta
from helios.server.app import ServerConfig
from helios.server.serve import DrainingServer, HttpLimits, uvicorn_server

CONTEXT = 128
SAFETY_S = 10.0  # how long a test socket waits before the test fails; the server's limits are far shorter
QUICK = HttpLimits(head_timeout_s=0.2, body_timeout_s=0.2, keep_alive_s=5.0, max_head_bytes=4096)


class CountingTokenizer(ByteTokenizer):
    """Byte tokens (so one token never stands for more than one byte), counting encode calls."""

    max_token_bytes = 1

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[int] = []  # lengths of the texts encoded

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens=add_special_tokens)


class LoadedEngine(FakeEngine):
    """A fake whose waiting line is full for prompts starting with ``!full``, and that times out
    prompts starting with ``!wait`` as if they never got a slot."""

    def __init__(self) -> None:
        super().__init__(context_length=CONTEXT)
        self.tokenizer = CountingTokenizer()

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
    server = uvicorn_server(engine, ServerConfig(), log_level="warning", grace_s=0.2, limits=QUICK)
    with serving_in_thread(server) as url:
        yield Running(url, int(url.rsplit(":", 1)[1]), engine, server)


def _completion(prompt, **extra) -> dict:
    return {"model": "fake-model", "prompt": prompt, **extra}


def _samples(url: str, name: str) -> dict[tuple, float]:
    """Samples of ``name`` by their labels, less ``model_name`` (every family carries the served model's)."""
    text = httpx.get(f"{url}/metrics").text
    found = {}
    for sample in (s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name):
        labels = dict(sample.labels)
        assert labels.pop("model_name") == "fake-model", sample
        found[tuple(sorted(labels.items()))] = sample.value
    return found


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


# ---------------------------------------------------------------- slow clients


def _connect(served: Running) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.port))
    sock.settimeout(SAFETY_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a test failure if it never does)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {SAFETY_S} s; it sent {received[:200]!r}")
    finally:
        sock.close()
    return received


def test_a_connection_that_sends_nothing_is_closed(served):
    assert _read_until_closed(_connect(served)) == b""


def test_a_connection_that_never_finishes_its_request_head_is_closed(served):
    sock = _connect(served)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert _read_until_closed(sock) == b""


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closes(served):
    sock = _connect(served)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\":")
    head, _, body = _read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "did not arrive within 0.2 s" in error["message"]


def test_a_kept_alive_connection_must_finish_its_next_head_too(served):
    sock = _connect(served)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while b"\"ok\"" not in first:
        first += sock.recv(4096)
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # and then nothing: each byte used to restart keep-alive
    assert _read_until_closed(sock) == b""


def test_a_request_head_growing_past_the_limit_gets_400(served):
    sock = _connect(served)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 8192)  # no end of head yet
    assert _read_until_closed(sock).startswith(b"HTTP/1.1 400")


def test_http_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="body_timeout_s must be > 0"):
        HttpLimits(body_timeout_s=0)
    with pytest.raises(ValueError, match="max_head_bytes must be >= 1024"):
        HttpLimits(max_head_bytes=10)


# ---------------------------------------------------------------- text too long to tokenize


def test_a_prompt_whose_length_proves_it_too_long_is_refused_before_tokenizing(served):
    tokenizer = served.engine.tokenizer
    tokenizer.encoded.clear()
    response = httpx.post(f"{served.url}/v1/completions", json=_completion("a" * CONTEXT, max_tokens=1))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"at least {CONTEXT} tokens" in error["message"]
    assert tokenizer.encoded == [], "the prompt was tokenized although its length already proved it too long"


def test_a_chat_whose_rendered_text_proves_it_too_long_is_refused_before_tokenizing(served):
    tokenizer = served.engine.tokenizer
    tokenizer.encoded.clear()
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "b" * CONTEXT}]}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert tokenizer.encoded == []


def test_a_prompt_that_may_fit_is_tokenized_and_served(served):
    tokenizer = served.engine.tokenizer
    tokenizer.encoded.clear()
    response = httpx.post(f"{served.url}/v1/completions", json=_completion("a" * (CONTEXT - 8), max_tokens=4))
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "aaaa"
    assert tokenizer.encoded == [CONTEXT - 8]
