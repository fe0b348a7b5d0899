"""The HTTP layer over a fake engine: real uvicorn on loopback, real clients (httpx, openai).

The fake echoes the prompt's bytes and then EOS (see fake_engine.py), so every
expected text below follows from the request alone.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import EOS, FakeEngine
from server_process import serving_in_thread, wait_until
from helios.runtime.engine_api import EngineStats, ExecutionTotals, FinishReason, SpeculativeTotals
from helios.runtime.engine_api import ChatTemplateError
from helios.server.app import INLINE_PREPARE_BYTES, ServerConfig
from helios.text.chat_template import ChatTemplate
from helios.server.serve import DrainingServer, uvicorn_server

CONTEXT = 128
BODY_LIMIT = 16 * 1024
API_KEY = "sekret-key"
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Running:
    url: str
    engine: FakeEngine
    server: DrainingServer

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, **kwargs)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=10.0)


def _serve(engine: FakeEngine, config: ServerConfig, grace_s: float = 1.0) -> Iterator[Running]:
    server = uvicorn_server(engine, config, log_level="warning", grace_s=grace_s)
    with serving_in_thread(server) as url:
        yield Running(url, engine, server)


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    yield from _serve(FakeEngine(context_length=CONTEXT), ServerConfig(max_body_bytes=BODY_LIMIT))


@pytest.fixture(scope="module")
def keyed() -> Iterator[Running]:
    yield from _serve(FakeEngine(context_length=CONTEXT), ServerConfig(api_key=API_KEY))


@pytest.fixture()
def slow() -> Iterator[Running]:
    """A server whose engine spends 20 ms per token, so a client can leave mid-generation."""
    yield from _serve(FakeEngine(context_length=4096, token_delay_s=0.02), ServerConfig(), grace_s=0.2)


def _chat(content: str, **extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}


def _completion(prompt, **extra) -> dict:
    return {"model": "fake-model", "prompt": prompt, **extra}


def _sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------- non-streamed responses


def test_completion_returns_whole_text_with_usage(served):
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion("hello", max_tokens=16)).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "stop"}]
    # five echoed bytes plus the EOS token
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_max_tokens_cuts_with_length(served):
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion("hello", max_tokens=3)).json()
    assert body["choices"][0]["text"] == "hel" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_completion_default_max_tokens_is_16(served):
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion("abcdefghijklmnopqrstuvwxyz")).json()
    assert body["choices"][0]["text"] == "abcdefghijklmnop"
    assert served.engine.submitted[-1].max_tokens == 16


def test_completion_accepts_token_ids_and_single_item_batches(served):
    with served.client() as client:
        by_ids = client.post("/v1/completions", json=_completion([104, 105])).json()
        batch = client.post("/v1/completions", json=_completion(["yo"])).json()
    assert by_ids["choices"][0]["text"] == "hi"
    assert batch["choices"][0]["text"] == "yo"


def test_chat_renders_the_template_and_answers_as_assistant(served):
    with served.client() as client:
        body = client.post("/v1/chat/completions", json=_chat("hi")).json()
    prompt = "[user] hi\n[assistant] "
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": prompt}, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(prompt) + 1, "total_tokens": 2 * len(prompt) + 1,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # chat's default max_tokens is the rest of the context
    assert served.engine.submitted[-1].max_tokens == CONTEXT - len(prompt)


def test_K1_chat_request_carries_message_endpoints(served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]
    with served.client() as client:
        client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages, "max_tokens": 1})
    lines = ["[system] be brief\n", "[user] hi\n", "[assistant] yo\n"]
    expected = tuple(sum(len(line) for line in lines[: i + 1]) for i in range(3))
    assert served.engine.submitted[-1].endpoints == expected


def test_chat_text_content_parts_are_joined(served):
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    with served.client() as client:
        body = client.post("/v1/chat/completions", json=_chat(content)).json()
    assert body["choices"][0]["message"]["content"] == "[user] ab\n[assistant] "


def test_sampling_fields_and_stop_pass_through_to_the_engine(served):
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion(
            "hello world", temperature=0.5, top_p=0.9, top_k=5, seed=7, stop=["o w", "zz"], max_tokens=20)).json()
    sent = served.engine.submitted[-1]
    assert (sent.sampling.temperature, sent.sampling.top_p, sent.sampling.top_k, sent.sampling.seed) == (0.5, 0.9, 5, 7)
    assert sent.stop == ("o w", "zz") and sent.max_tokens == 20
    assert body["choices"][0]["text"] == "hell" and body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_stop_as_a_plain_string_is_one_stop_string(served, endpoint):
    """The most common form, ``"stop": "\n"``: a single string, not a list (the OpenAI API allows both)."""
    body = _completion("hello world", stop="o w") if endpoint == "/v1/completions" else {
        "model": "fake-model", "messages": [{"role": "user", "content": "hello world"}], "stop": "o w"}
    with served.client() as client:
        reply = client.post(endpoint, json=body)
    assert reply.status_code == 200, reply.text
    assert served.engine.submitted[-1].stop == ("o w",)
    assert reply.json()["choices"][0]["finish_reason"] == "stop"


def test_top_k_minus_one_and_nulls_mean_defaults(served):
    with served.client() as client:
        client.post("/v1/completions", json=_completion("x", top_k=-1, temperature=None, top_p=None, stop=None))
    sampling = served.engine.submitted[-1].sampling
    assert (sampling.top_k, sampling.temperature, sampling.top_p, served.engine.submitted[-1].stop) == (None, 1.0, 1.0, ())


def test_unknown_fields_are_ignored(served):
    # OpenAI's bookkeeping fields, which cannot change the output (docs/http-api.md: "no effect"), and a made-up one
    bookkeeping = {"user": "someone", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                   "safety_identifier": "abc", "prompt_cache_key": "key", "parallel_tool_calls": True}
    with served.client() as client:
        response = client.post("/v1/completions", json=_completion("hi", frobnicate={"x": 1}, **bookkeeping))
        chat = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": [
            {"role": "user", "content": "hi"}], **bookkeeping})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "hi"
    assert chat.status_code == 200, chat.text


def test_openai_client_non_stream(served):
    client = served.openai()
    completion = client.completions.create(model="fake-model", prompt="abc", max_tokens=10)
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "yo"}])
    assert completion.choices[0].text == "abc" and completion.usage.completion_tokens == 4
    assert chat.choices[0].message.content == "[user] yo\n[assistant] " and chat.choices[0].finish_reason == "stop"


def test_models_lists_the_served_model(served):
    models = served.openai().models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    with served.client() as client:
        card = client.get("/v1/models/fake-model").json()
        missing = client.get("/v1/models/other")
    assert card["max_model_len"] == CONTEXT and card["object"] == "model"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_health_and_lifespan(served):
    with served.client() as client:
        assert client.get("/health").json() == {"status": "ok"}
    assert served.engine.started


# ---------------------------------------------------------------- streams


def test_completion_stream_sse_framing(served):
    with served.client() as client, client.stream("POST", "/v1/completions", json=_completion("abc", stream=True)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    assert all("usage" not in c for c in chunks)


def test_chat_stream_without_usage(served):
    stream = served.openai().chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "[user] hi\n[assistant] "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks) and all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_stream_include_usage_ends_with_usage_chunk(served):
    stream = served.openai().chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=4,
        stream_options={"include_usage": True})
    chunks = list(stream)
    prompt_tokens = len("[user] hi\n[assistant] ")
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.total_tokens == prompt_tokens + 4
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "[use"


def test_completion_stream_include_usage_raw(served):
    body = _completion("hey", stream=True, stream_options={"include_usage": True})
    with served.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        events = _sse_events(response)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                                       "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None for c in chunks[:-1])


def test_openai_client_completion_stream(served):
    chunks = list(served.openai().completions.create(model="fake-model", prompt="xyz", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "xyz"
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- bad requests

OK_CHAT = _chat("hi")
OK_COMPLETION = _completion("hi")
LONG = "x" * 200  # 200 tokens against a 128-token context

BAD_REQUESTS = [
    # (route, body (dict or raw bytes), status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "hi", "temperature": NaN}', 400, None),
    ("/v1/completions", OK_COMPLETION | {"temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", OK_COMPLETION | {"stream": "yes"}, 400, "stream"),
    ("/v1/completions", OK_COMPLETION | {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a", [104, True]]}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": []}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a"] * 257}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a", "x" * 200]}, 400, "prompt.1"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a", [104, 999]]}, 400, "prompt.1"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a"] * 17, "n": 16}, 400, "n"),
    ("/v1/completions", OK_COMPLETION | {"n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", OK_COMPLETION | {"n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", OK_COMPLETION | {"prompt": [104, 999]}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"stop": 5}, 400, "stop"),
    ("/v1/completions", OK_COMPLETION | {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"model": "fake-model"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/chat/completions", {"model": "fake-model"}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", OK_CHAT | {"model": "gpt-4"}, 404, "model"),
    ("/v1/completions", OK_COMPLETION | {"model": "gpt-4"}, 404, "model"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"temperature": -0.1}, 400, "temperature"),
    ("/v1/chat/completions", OK_CHAT | {"temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", OK_CHAT | {"top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", OK_CHAT | {"top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", OK_CHAT | {"top_k": 0}, 400, "top_k"),
    ("/v1/chat/completions", OK_CHAT | {"top_k": -2}, 400, "top_k"),
    ("/v1/chat/completions", OK_CHAT | {"n": 0}, 400, "n"),
    ("/v1/chat/completions", OK_CHAT | {"n": 17}, 400, "n"),
    ("/v1/chat/completions", OK_CHAT | {"n": 2.0}, 400, "n"),
    ("/v1/completions", OK_COMPLETION | {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"echo": "yes"}, 400, "echo"),
    ("/v1/chat/completions", OK_CHAT | {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", OK_CHAT | {"logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", OK_CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", OK_CHAT | {"top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", OK_COMPLETION | {"logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", OK_COMPLETION | {"logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", OK_COMPLETION | {"echo": "yes"}, 400, "echo"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("/v1/completions", OK_COMPLETION | {"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", OK_COMPLETION | {"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", OK_CHAT | {"prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", OK_CHAT | {"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", OK_COMPLETION | {"presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", OK_COMPLETION | {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/completions", OK_COMPLETION | {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", OK_COMPLETION | {"min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", OK_COMPLETION | {"logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("/v1/completions", OK_COMPLETION | {"logit_bias": {"104": 101}}, 400, "logit_bias"),
    ("/v1/completions", OK_COMPLETION | {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", OK_COMPLETION | {"logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("/v1/completions", OK_COMPLETION | {"stop_token_ids": [999]}, 400, "stop_token_ids"),
    ("/v1/completions", OK_COMPLETION | {"stop_token_ids": list(range(20))}, 400, "stop_token_ids"),
    ("/v1/completions", OK_COMPLETION | {"min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", OK_COMPLETION | {"min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", OK_COMPLETION | {"min_tokens": 2, "stop": "x"}, 400, "min_tokens"),
    ("/v1/completions", OK_COMPLETION | {"ignore_eos": 1}, 400, "ignore_eos"),
    ("/v1/chat/completions", OK_CHAT | {"top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", OK_COMPLETION | {"suffix": "end"}, 400, "suffix"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/completions", OK_COMPLETION | {"seed": 2**70}, 400, "seed"),
    ("/v1/completions", _completion(LONG), 400, "prompt"),
    ("/v1/chat/completions", _chat(LONG), 400, "messages"),
    ("/v1/completions", _completion("!reject me"), 400, "prompt"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS, ids=[f"{r[0][4:]}-{i}" for i, r in enumerate(BAD_REQUESTS)])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_bad_request_gets_4xx_in_openai_error_shape(served, route, body, status, param, stream):
    if stream and isinstance(body, dict) and "stream" not in body and "stream_options" not in body:
        body = body | {"stream": True}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with served.client() as client:
        response = client.post(route, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_prompt_longer_than_context_says_the_numbers(served):
    with served.client() as client:
        too_long = client.post("/v1/completions", json=_completion(LONG)).json()["error"]["message"]
        too_much = client.post("/v1/completions", json=_completion("x" * 100, max_tokens=50)).json()["error"]["message"]
    assert "200" in too_long and str(CONTEXT) in too_long
    assert all(n in too_much for n in ("100", "50", "150", str(CONTEXT), "28"))


def test_oversized_body_gets_413(served):
    body = _completion("a" * (BODY_LIMIT + 10))
    with served.client() as client:
        declared = client.post("/v1/completions", json=body)
        chunked = client.post("/v1/completions", content=iter([json.dumps(body).encode()]))  # no content-length
    for response in (declared, chunked):
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_large_bodies_are_prepared_in_a_worker_thread_with_the_same_answers(slow):
    """Bodies over INLINE_PREPARE_BYTES take the worker-thread path; results and errors must not change."""
    padding = "x" * (INLINE_PREPARE_BYTES + 1)
    with slow.client() as client:
        fine = client.post("/v1/completions", json=_completion("ok", padding=padding))
        too_long = client.post("/v1/completions", json=_completion(padding))
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == "ok"
    assert too_long.status_code == 400 and str(len(padding)) in too_long.json()["error"]["message"]


def test_openai_client_sees_bad_request_and_not_found(served):
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    assert bad.value.body["param"] == "temperature"


def test_unknown_route_and_method_use_the_error_shape(served):
    with served.client() as client:
        missing = client.get("/v1/nothing")
        wrong_method = client.get("/v1/completions")
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    assert wrong_method.status_code == 405 and "message" in wrong_method.json()["error"]


# ---------------------------------------------------------------- engine failures


def test_engine_failure_is_a_500_or_an_error_event(served):
    with served.client() as client:
        whole = client.post("/v1/completions", json=_completion("!fail now"))
        with client.stream("POST", "/v1/completions", json=_completion("!fail now", stream=True)) as response:
            events = _sse_events(response)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"


def test_draining_engine_gives_503_and_unhealthy(served):
    served.engine.accepting = False
    try:
        with served.client() as client:
            response = client.post("/v1/completions", json=OK_COMPLETION)
            health = client.get("/health")
    finally:
        served.engine.accepting = True
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503


# ---------------------------------------------------------------- auth


def test_api_key_required_everywhere_but_health(keyed):
    good = {"Authorization": f"Bearer {API_KEY}"}
    with keyed.client() as client:
        assert client.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/v1/nothing"):
            assert client.get(path).status_code == 401
        missing = client.post("/v1/completions", json=OK_COMPLETION)
        wrong = client.post("/v1/completions", json=OK_COMPLETION, headers={"Authorization": "Bearer nope"})
        right = client.post("/v1/completions", json=OK_COMPLETION, headers=good)
        assert client.get("/metrics", headers=good).status_code == 200
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "invalid_request_error" and response.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200 and right.json()["choices"][0]["text"] == "hi"


def test_openai_client_with_and_without_the_key(keyed):
    assert keyed.openai(API_KEY).completions.create(model="fake-model", prompt="ok").choices[0].text == "ok"
    with pytest.raises(openai.AuthenticationError):
        keyed.openai("wrong").models.list()


# ---------------------------------------------------------------- disconnects


def test_stream_disconnect_cancels_the_engine_request(slow):
    prompt = "z" * 300  # 300 tokens at 20 ms each: far longer than the client stays
    with slow.client() as client, client.stream("POST", "/v1/completions", json=_completion(prompt, stream=True, max_tokens=300)) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    request_id = json.loads(first.removeprefix("data: "))["id"]
    wait_until(lambda: request_id in slow.engine.cancelled, "the engine to see the cancellation")
    wait_until(lambda: slow.engine.stats().requests_running == 0, "the request to leave the engine")


def test_stream_disconnect_before_any_output_cancels(slow):
    slow.engine.first_token_delay_s = 60.0  # the engine stays silent far longer than the wait below
    with slow.client() as client, client.stream("POST", "/v1/completions", json=_completion("abc", stream=True)) as response:
        assert response.status_code == 200
    wait_until(lambda: len(slow.engine.cancelled) == 1, "the engine to see the cancellation")
    assert slow.engine.cancelled == [slow.engine.submitted[-1].request_id]


def test_non_stream_disconnect_cancels_the_engine_request(slow):
    with slow.client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=_completion("q" * 300, max_tokens=300), timeout=httpx.Timeout(10.0, read=0.3))
    wait_until(lambda: len(slow.engine.cancelled) == 1, "the engine to see the cancellation")
    assert slow.engine.cancelled == [slow.engine.submitted[-1].request_id]


def test_finished_requests_are_not_cancelled(served):
    before = len(served.engine.cancelled)
    with served.client() as client:
        client.post("/v1/completions", json=_completion("done", max_tokens=2))
        with client.stream("POST", "/v1/chat/completions", json=_chat("ok", stream=True)) as response:
            _sse_events(response)
    assert len(served.engine.cancelled) == before


def test_shutdown_drains_running_streams_with_abort(slow):
    body = _completion("s" * 300, stream=True, max_tokens=300)
    with slow.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        slow.server.should_exit = True  # what SIGTERM does
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    assert not slow.engine.accepting and slow.engine.cancelled == []
    wait_until(lambda: slow.engine.stopped, "the lifespan to stop the engine")


async def _one_client(client: httpx.AsyncClient, rng: random.Random, index: int) -> str | None:
    """One request that may leave early; returns the text when it read everything."""
    prompt = f"request {index:02d} " + "p" * rng.randint(1, 20)
    body = _completion(prompt, max_tokens=24, stream=rng.random() < 0.7)
    leave_after = rng.choice([None, 0, 1, 3, 10])  # events read before leaving; None reads all
    if not body["stream"]:
        if leave_after is not None:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.05))
            return None
        return (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    async with client.stream("POST", "/v1/completions", json=body) as response:
        texts = []
        async for line in response.aiter_lines():
            if leave_after is not None and len(texts) >= leave_after:
                return None  # leaving the block closes this connection mid-stream
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(texts)


def test_concurrent_clients_with_random_disconnects_end_every_request_exactly_once(slow):
    slow.engine.token_delay_s = 0.005
    rng = random.Random(5)

    async def main():
        # one client for all: building an httpx client costs tens of milliseconds
        async with httpx.AsyncClient(base_url=slow.url, timeout=10.0, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_one_client(client, rng, i) for i in range(40)))

    texts = asyncio.run(main())
    engine = slow.engine
    wait_until(lambda: len(engine.finished) + len(engine.cancelled) == len(engine.submitted), "every request to end")
    assert set(engine.finished).isdisjoint(engine.cancelled)
    assert len(set(engine.cancelled)) == len(engine.cancelled) and engine.stats().requests_running == 0
    for i, text in enumerate(texts):
        if text is not None:  # read to the end: exactly its own echo, never a neighbour's
            assert text.startswith(f"request {i:02d} ") and set(text[11:]) <= {"p"}


# ---------------------------------------------------------------- metrics


def _scrape(running: Running) -> dict:
    with running.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def _value(families: dict, name: str, sample: str, **labels) -> float:
    matches = [s.value for s in families[name].samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(matches)


def test_D9_metrics_expose_engine_stats_by_graph_kind_category_and_proposal_source(served):
    served.engine.base_stats = EngineStats(
        requests_waiting=3, kv_pages_used=40, kv_pages_free=24,
        executions=(ExecutionTotals("decode", "ordinary", 7, 7_000), ExecutionTotals("decode", "timing_refresh", 1, 900),
                    ExecutionTotals("prefill", "discovery", 2, 5_000)),
        speculative=(SpeculativeTotals("copy", 2, 6, 1, 3, (1,)),
                     SpeculativeTotals("learned", 5, 15, 9, 14, (4, 3, 2))))
    try:
        families = _scrape(served)
    finally:
        served.engine.base_stats = EngineStats()
    execs, nanos = "flare_scheduler_executions", "flare_scheduler_execution_nanoseconds"
    assert _value(families, execs, execs + "_total", graph_kind="decode", category="ordinary") == 7
    assert _value(families, nanos, nanos + "_total", graph_kind="decode", category="timing_refresh") == 900
    assert _value(families, nanos, nanos + "_total", graph_kind="prefill", category="discovery") == 5_000
    for kind in ("decode", "prefill"):
        categories = {s.labels["category"] for s in families[execs].samples if s.labels["graph_kind"] == kind and s.name.endswith("_total")}
        assert categories == {"ordinary", "discovery", "timing_refresh", "acceptance_learning"}
    assert _value(families, "flare_requests_waiting", "flare_requests_waiting") == 3
    assert _value(families, "flare_kv_pages_used", "flare_kv_pages_used") == 40
    assert _value(families, "flare_kv_pages_free", "flare_kv_pages_free") == 24
    spec = "flare_speculative_"
    assert _value(families, spec + "accepted_tokens", spec + "accepted_tokens_total", source="learned") == 9
    assert _value(families, spec + "draft_tokens", spec + "draft_tokens_total", source="learned") == 15
    assert _value(families, spec + "rounds", spec + "rounds_total", source="copy") == 2
    assert _value(families, spec + "emitted_tokens", spec + "emitted_tokens_total", source="copy") == 3
    per_position = spec + "accepted_per_position"
    assert [_value(families, per_position, per_position + "_total", source="learned", position=str(i))
            for i in (1, 2, 3)] == [4, 3, 2]
    assert _value(families, per_position, per_position + "_total", source="copy", position="1") == 1
    assert families["flare_requests_running"].type == "gauge"


def test_metrics_count_requests_tokens_and_latencies(served):
    before = _scrape(served)
    with served.client() as client:
        client.post("/v1/completions", json=_completion("hello", max_tokens=2))  # length, 5 prompt, 2 generated
        client.post("/v1/completions", json=_completion("hi"))  # stop, 2 prompt, 3 generated (with EOS)
        client.post("/v1/completions", json=_completion("hi", top_p=7))  # rejected
    after = _scrape(served)

    def delta(name, sample, **labels):
        return _value(after, name, sample, **labels) - _value(before, name, sample, **labels)

    assert delta("flare_requests", "flare_requests_total", endpoint="completions", outcome="length") == 1
    assert delta("flare_requests", "flare_requests_total", endpoint="completions", outcome="stop") == 1
    assert delta("flare_requests", "flare_requests_total", endpoint="completions", outcome="rejected") == 1
    assert delta("flare_prompt_tokens", "flare_prompt_tokens_total") == 7
    assert delta("flare_generation_tokens", "flare_generation_tokens_total") == 5
    assert delta("flare_time_to_first_token_seconds", "flare_time_to_first_token_seconds_count") == 2
    # gaps between deliveries: one fewer than the tokens of each request
    assert delta("flare_inter_token_seconds", "flare_inter_token_seconds_count") == (2 - 1) + (3 - 1)
    assert after["flare_time_to_first_token_seconds"].type == "histogram"


def test_cancelled_stream_is_counted_as_cancelled(slow):
    with slow.client() as client, client.stream("POST", "/v1/completions", json=_completion("w" * 200, stream=True, max_tokens=200)) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_until(lambda: len(slow.engine.cancelled) == 1, "the cancellation")
    wait_until(lambda: _value(_scrape(slow), "flare_requests", "flare_requests_total", outcome="cancelled") == 1, "the cancelled count")


# ---------------------------------------------------------------- chat templates


def test_bundled_checkpoint_chat_template_renders_with_jinja():
    config = REPO / "ignition/models/bundled/flare-tiny/target/tokenizer_config.json"
    template = ChatTemplate.from_tokenizer_config(config)
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.eos_token == "<|im_end|>"


def test_template_raise_exception_becomes_chat_template_error():
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_fake_engine_byte_rules():
    """The fake's own rules that the expectations above rely on."""
    from fake_engine import planned_output

    assert planned_output(b"hello", 16, ()) == (b"hello", FinishReason.STOP)
    assert planned_output(b"hello", 5, ()) == (b"hello", FinishReason.LENGTH)  # no room left for EOS
    assert planned_output(b"hello", 16, ("ll",)) == (b"he", FinishReason.STOP)
    assert EOS == 256


def test_checkpoint_tokenizer_on_the_bundled_files():
    from helios.runtime.engine_api import EngineTokenizer
    from helios.text.tokenizer import CheckpointTokenizer

    tokenizer = CheckpointTokenizer.from_folder(REPO / "ignition/models/bundled/flare-tiny/target")
    assert isinstance(tokenizer, EngineTokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hé"}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    # each chat marker is one special token; the text between them round-trips byte for byte
    markers = {tokenizer.encode(m, add_special_tokens=False)[0] for m in ("<|im_start|>", "<|im_end|>")}
    assert sum(i in markers for i in ids) == 3
    assert tokenizer.decode(ids) == "user\nhé\nassistant\n"
    assert tokenizer.vocab_size == len(json.loads((REPO / "ignition/models/bundled/flare-tiny/target/tokenizer.json")
                                                  .read_text())["model"]["vocab"])


# A value of each field the engine does not honour yet, which must be refused rather than ignored.
UNHONOURED_VALUES = {
    "response_format": {"type": "json_object"}, "tool_choice": "required",
    "length_penalty": 0.5, "use_beam_search": True, "truncate_prompt_tokens": 10,
    "add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False}, "guided_json": {}, "guided_regex": "a+",
    "guided_choice": ["a"], "guided_grammar": "x", "structured_outputs": {"json": {}},
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "functions": [{"name": "f"}], "function_call": "auto", "web_search_options": {},
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high", "verbosity": "low",
    "priority": 1, "request_id": "mine",
}


def test_every_unhonoured_field_has_a_refused_value_here():
    from helios.server.protocol import UNHONOURED

    assert set(UNHONOURED_VALUES) == set(UNHONOURED)


def _unhonoured_cases() -> list[tuple[str, str]]:
    """(endpoint, field) for every field an endpoint refuses: those its body does not define (chat honours
    its template fields, tested below)."""
    from helios.server.protocol import ChatBody, CompletionBody

    bodies = {"/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody}
    return [(endpoint, field) for endpoint, body in bodies.items() for field in sorted(UNHONOURED_VALUES)
            if field not in body.model_fields]


@pytest.mark.parametrize("endpoint, field", _unhonoured_cases())
def test_a_field_the_engine_does_not_honour_is_refused_not_ignored(served, endpoint, field):
    body = _completion("hi") if endpoint == "/v1/completions" else {
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    with served.client() as client:
        reply = client.post(endpoint, json={**body, field: UNHONOURED_VALUES[field]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == field, error


def test_unhonoured_fields_sent_with_values_that_ask_for_nothing_are_accepted(served):
    from helios.server.protocol import UNHONOURED

    defaults = {name: values[-1] for name, values in UNHONOURED.items()}  # e.g. min_p 0.0, ignore_eos false
    with served.client() as client:
        reply = client.post("/v1/completions", json=_completion("hi", **defaults, stream=True,
                                                                stream_options={"continuous_usage_stats": False}))
    assert reply.status_code == 200, reply.text


def test_continuous_usage_stats_is_refused_not_ignored(served):
    with served.client() as client:
        reply = client.post("/v1/completions", json=_completion(
            "hi", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options.continuous_usage_stats"



def _chat_body(messages, **extra) -> dict:
    return {"model": "fake-model", "messages": messages, **extra}


CONVERSATION = [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "Once upon"}]


def test_chat_add_generation_prompt_false_leaves_the_assistant_turn_unopened(served):
    """The fake engine echoes its prompt, so the reply is the rendered prompt (fake_engine.py's template)."""
    with served.client() as client:
        opened = client.post("/v1/chat/completions", json=_chat_body(CONVERSATION[:1])).json()
        closed = client.post("/v1/chat/completions", json=_chat_body(CONVERSATION[:1], add_generation_prompt=False)).json()
    assert opened["choices"][0]["message"]["content"] == "[user] yo\n[assistant] "
    assert closed["choices"][0]["message"]["content"] == "[user] yo\n"


def test_chat_continue_final_message_ends_the_prompt_inside_that_message(served):
    with served.client() as client:
        reply = client.post("/v1/chat/completions", json=_chat_body(CONVERSATION, continue_final_message=True)).json()
        both = client.post("/v1/chat/completions", json=_chat_body(CONVERSATION, continue_final_message=True,
                                                              add_generation_prompt=True))
        empty = client.post("/v1/chat/completions", json=_chat_body([{"role": "assistant", "content": ""}],
                                                               continue_final_message=True))
    assert reply["choices"][0]["message"]["content"] == "[user] yo\n[assistant] Once upon"  # no closing newline
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "continue_final_message"


def test_completions_still_refuse_the_chat_template_fields(served):
    with served.client() as client:
        reply = client.post("/v1/completions", json=_completion("hi", add_generation_prompt=False))
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "unsupported_parameter"



def test_chat_template_kwargs_reach_the_template_and_cannot_override_what_the_server_sets(served):
    saved = served.engine.tokenizer.template
    served.engine.tokenizer.template = ChatTemplate(
        "{% if enable_thinking %}<think>{% endif %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    try:
        with served.client() as client:
            thinking = client.post("/v1/chat/completions", json=_chat_body(CONVERSATION[:1],
                                                                           chat_template_kwargs={"enable_thinking": True}))
            plain = client.post("/v1/chat/completions", json=_chat_body(CONVERSATION[:1]))
            clash = client.post("/v1/chat/completions", json=_chat_body(
                CONVERSATION[:1], chat_template_kwargs={"add_generation_prompt": False}))
    finally:
        served.engine.tokenizer.template = saved
    assert thinking.json()["choices"][0]["message"]["content"] == "<think>[user] yo\n"
    assert plain.json()["choices"][0]["message"]["content"] == "[user] yo\n"
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"
