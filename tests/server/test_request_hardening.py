"""Bodies and headers that used to pass validation and then break something (issue 17, parts 1, 2, 8).

One uvicorn server on loopback (port 0) over the fake engine, with an API
key, so the same server answers the authentication cases. Every refusal must
be a 4xx in OpenAI's error shape naming the field, and counted in
``flare_requests_total``; a 500 is only ever a server fault, logged with its
traceback and counted too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import ByteTokenizer, FakeEngine
from server_process import serving_in_thread
from helios.server.app import ServerConfig
from helios.server.serve import uvicorn_server

API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
SURROGATE = "\\ud800"  # as it appears in the JSON text: a lone UTF-16 surrogate, not a character


class TrippingTokenizer(ByteTokenizer):
    """Raises an unexpected error (not a refusal) on one prompt: a tokenizer bug or an input it chokes on."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if text == "trip the tokenizer":
            raise RuntimeError("tokenizer choked")
        return super().encode(text, add_special_tokens=add_special_tokens)


class FaultyEngine(FakeEngine):
    """``submit`` raises an unexpected error on one prompt: a server fault, which must be a 500."""

    def __init__(self) -> None:
        super().__init__(context_length=256)
        self.tokenizer = TrippingTokenizer()

    def submit(self, request):
        if bytes(t for t in request.prompt_token_ids if t < 256) == b"explode":
            raise RuntimeError("engine bug")
        return super().submit(request)


@dataclass
class Served:
    url: str
    engine: FaultyEngine

    def client(self, headers=AUTH) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, headers=headers)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = FaultyEngine()
    server = uvicorn_server(engine, ServerConfig(api_key=API_KEY), log_level="warning", grace_s=0.5)
    with serving_in_thread(server) as url:
        yield Served(url, engine)


@pytest.fixture()
def client(served) -> Iterator[httpx.Client]:
    with served.client() as c:
        yield c


def completion(**fields) -> dict:
    return {"model": "fake-model", "prompt": "hello", "max_tokens": 4, **fields}


def chat(content, **fields) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def post_raw(client: httpx.Client, path: str, body: str) -> httpx.Response:
    return client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


def requests_total(client: httpx.Client, **labels) -> float:
    text = client.get("/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "flare_requests")
    return sum(s.value for s in family.samples
               if s.name == "flare_requests_total" and all(s.labels.get(k) == v for k, v in labels.items()))


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# ---------------------------------------------------------------- part 1: only what the engine can represent


@pytest.mark.parametrize("asked, engine_seed", [
    (2**63, INT64_MIN), (UINT64_MAX, -1), (2**63 - 1, 2**63 - 1), (INT64_MIN, INT64_MIN), (-1, -1), (12345, 12345),
    (UINT64_MAX + 1, None), (INT64_MIN - 1, None), (10**30, None),  # None: refused
])
def test_seeds_reach_the_engine_as_the_int64_with_the_same_64_bits_and_wider_ones_are_refused(
        served, client, asked, engine_seed):
    before = len(served.engine.submitted)
    response = client.post("/v1/completions", json=completion(seed=asked, temperature=0.7))
    if engine_seed is None:
        assert "seed" in assert_openai_error(response, 400, "seed", "invalid_value")["message"]
        assert len(served.engine.submitted) == before
    else:
        assert response.status_code == 200, response.text
        assert served.engine.submitted[before].sampling.seed == engine_seed


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**40, 5000])
def test_a_top_k_above_the_vocabulary_is_clamped_to_it(served, client, top_k):
    before = len(served.engine.submitted)
    assert client.post("/v1/chat/completions", json=chat("hi", top_k=top_k)).status_code == 200
    assert served.engine.submitted[before].sampling.top_k == served.engine.tokenizer.vocab_size


# ---------------------------------------------------------------- part 2: bodies that must be 400, never 500


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("body", [
    '{"model": "fake-model", "prompt": "hi", "junk": ' + nested(100_000) + "}",  # an ignored field
    '{"model": "fake-model", "prompt": ' + nested(1_000) + "}",
    '{"model": "fake-model", "prompt": ' + nested(900) + "}",  # parses, then nests too deep to report
    '{"model": "fake-model", "prompt": "hi", "stop": ' + nested(5_000) + "}",
    '{"model": "fake-model", "prompt": "hi", "junk": ' + '{"a": ' * 3_000 + "1" + "}" * 3_000 + "}",
], ids=["ignored-list", "prompt", "prompt-900", "stop", "ignored-object"])
def test_deeply_nested_json_is_a_400_and_counted(client, body):
    before = requests_total(client, endpoint="completions", outcome="rejected")
    assert_openai_error(post_raw(client, "/v1/completions", body), 400)
    assert requests_total(client, endpoint="completions", outcome="rejected") == before + 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model": "fake-model", "prompt": "a' + SURROGATE + 'b"}', "prompt"),
    ("/v1/completions", '{"model": "fake-model", "prompt": ["' + SURROGATE + '"]}', "prompt"),
    ("/v1/completions", '{"model": "fake-model", "prompt": "hi", "stop": ["' + SURROGATE + '"]}', "stop"),
    ("/v1/completions", '{"model": "fake' + SURROGATE + '", "prompt": "hi"}', "model"),
    ("/v1/chat/completions", '{"model": "fake-model", "messages": [{"role": "user", "content": "' + SURROGATE + '"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "fake-model", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "x' + SURROGATE + '"}]}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"model": "fake-model", "messages": [{"role": "user", "content": "hi", '
     '"name": "' + SURROGATE + '"}]}', "messages.0.name"),
], ids=["prompt", "prompt-batch", "stop", "model", "chat-content", "chat-part", "chat-name"])
def test_a_lone_surrogate_is_a_400_naming_the_field_and_counted(client, path, body, param):
    endpoint = "chat" if "chat" in path else "completions"
    before = requests_total(client, endpoint=endpoint, outcome="rejected")
    error = assert_openai_error(post_raw(client, path, body), 400, param, "invalid_value")
    assert "surrogate" in error["message"]
    assert requests_total(client, endpoint=endpoint, outcome="rejected") == before + 1


def test_an_escaped_surrogate_pair_is_one_character_where_a_lone_surrogate_is_refused(client):
    pair = post_raw(client, "/v1/completions", '{"model": "fake-model", "prompt": "\\ud83d\\ude00", "max_tokens": 8}')
    assert pair.status_code == 200 and pair.json()["choices"][0]["text"] == "\U0001F600"
    high_only = post_raw(client, "/v1/completions", '{"model": "fake-model", "prompt": "\\ud83d x", "max_tokens": 8}')
    low_only = post_raw(client, "/v1/completions", '{"model": "fake-model", "prompt": "\\ude00", "max_tokens": 8}')
    assert_openai_error(high_only, 400, "prompt")
    assert_openai_error(low_only, 400, "prompt")


def test_any_error_while_preparing_a_body_is_a_400_and_counted(client):
    before = requests_total(client, endpoint="completions", outcome="rejected")
    error = assert_openai_error(client.post("/v1/completions", json=completion(prompt="trip the tokenizer")), 400)
    assert error["type"] == "invalid_request_error"
    assert requests_total(client, endpoint="completions", outcome="rejected") == before + 1


def test_a_server_fault_is_a_500_logged_with_its_traceback_and_counted(client, caplog):
    before = requests_total(client, endpoint="completions", outcome="error")
    with caplog.at_level(logging.ERROR, logger="helios.server"):
        response = client.post("/v1/completions", json=completion(prompt="explode"))
    error = assert_openai_error(response, 500, code="internal_error")
    assert error["type"] == "server_error" and "engine bug" not in error["message"]  # no internals to clients
    assert any(r.exc_info and "engine bug" in str(r.exc_info[1]) for r in caplog.records), caplog.text
    assert requests_total(client, endpoint="completions", outcome="error") == before + 1


# ---------------------------------------------------------------- part 8: headers, echoed names, top_p


@pytest.mark.parametrize("header, status", [
    (f"bearer {API_KEY}", 200), (f"BEARER {API_KEY}", 200), (f"BeArEr {API_KEY}", 200), (f"Bearer   {API_KEY}", 200),
    (f"Basic {API_KEY}", 401), (f"bearer {API_KEY}x", 401), ("bearer", 401), (API_KEY, 401),
    (f"Bearer {API_KEY} extra", 401), ("Bearer caf\u00e9".encode("latin-1"), 401),
])
def test_the_bearer_scheme_is_case_insensitive_and_nothing_else_is_loosened(served, header, status):
    with served.client({"Authorization": header}) as c:
        response = c.get("/v1/models")
    if status == 401:
        assert_openai_error(response, 401, code="invalid_api_key")
    assert response.status_code == status


@pytest.mark.parametrize("where", ["body", "path"])
def test_a_huge_unknown_model_name_is_cut_in_the_404(client, where):
    name = "m" * 100_000
    if where == "body":
        response = client.post("/v1/completions", json=completion(model=name))
    else:
        response = client.get(f"/v1/models/{'m' * 8_000}")  # a URL must fit the server's request-line limit
    error = assert_openai_error(response, 404, "model", "model_not_found")
    assert len(error["message"]) < 400 and "fake-model" in error["message"] and "mmmm" in error["message"]
