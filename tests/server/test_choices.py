"""Several choices per response (issue 18, item 3 and 5): ``n``, lists of prompts, chat's ``echo``,
``max_completion_tokens``, over the fake engine (which echoes its prompt's bytes, then EOS) and, for
the waiting line, over the real engine.

Every choice is its own engine request: the tests read what the engine was
submitted (ids, seeds, max_tokens) and what the client got (indexes, usage,
one ``[DONE]``), and what happens when a choice fails or the client leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_process import serving_in_thread, wait_until
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.server.app import ServerConfig
from helios.server.protocol import MAX_N, choice_seed
from helios.server.serve import uvicorn_server

CONTEXT = 128


@dataclass
class Running:
    url: str
    engine: FakeEngine

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=10.0)


def _serve(engine) -> Iterator[Running]:
    server = uvicorn_server(engine, ServerConfig(), log_level="warning", grace_s=0.2)
    with serving_in_thread(server) as url:
        yield Running(url, engine)


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    yield from _serve(FakeEngine(context_length=CONTEXT))


@pytest.fixture()
def slow() -> Iterator[Running]:
    yield from _serve(FakeEngine(context_length=4096, token_delay_s=0.02))


def _completion(prompt, **extra) -> dict:
    return {"model": "fake-model", "prompt": prompt, **extra}


def _chat(messages, **extra) -> dict:
    return {"model": "fake-model", "messages": messages, **extra}


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def _streamed(running: Running, path: str, body: dict) -> tuple[list[dict], list[str]]:
    with running.client() as client, client.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200
        events = _events(response)
    return [json.loads(e) for e in events if e != "[DONE]"], events


def _texts_by_index(chunks: list[dict], key=lambda choice: choice["text"]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (key(choice) or "")
    return texts


def _finishes(chunks: list[dict]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["finish_reason"] is not None:
                found.setdefault(choice["index"], []).append(choice["finish_reason"])
    return found


# ---------------------------------------------------------------- n and prompt lists, whole


def test_n_gives_n_choices_each_its_own_engine_request(served):
    before = len(served.engine.submitted)
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion("abc", n=3, max_tokens=8)).json()
    submitted = served.engine.submitted[before:]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["abc"] * 3
    assert [r.request_id for r in submitted] == [f"{body['id']}-{i}" for i in range(3)]
    assert all(r.prompt_token_ids == tuple(b"abc") for r in submitted)
    # the prompt counts once, as OpenAI and vLLM report it; the output of every choice counts
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_list_of_prompts_is_answered_prompt_major_then_choice(served):
    before = len(served.engine.submitted)
    prompts = ["ab", [104, 105], "xyz"]
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion(prompts, n=2, max_tokens=8)).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "ab"), (1, "ab"), (2, "hi"), (3, "hi"), (4, "xyz"), (5, "xyz")]
    assert [r.request_id for r in served.engine.submitted[before:]] == [f"{body['id']}-{i}" for i in range(6)]
    assert body["usage"]["prompt_tokens"] == 2 + 2 + 3
    assert body["usage"]["completion_tokens"] == 2 * (3 + 3 + 4)


def test_a_list_of_token_id_lists_is_a_batch(served):
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion([[104, 105], [111, 107]], max_tokens=8)).json()
    assert [c["text"] for c in body["choices"]] == ["hi", "ok"]


def test_each_prompt_of_a_batch_gets_its_own_default_max_tokens(served):
    before = len(served.engine.submitted)
    with served.client() as client:
        client.post("/v1/completions", json=_completion(["a", "x" * (CONTEXT - 4)]))
    assert [r.max_tokens for r in served.engine.submitted[before:]] == [16, 4]  # 16, or what fits


def test_one_choice_keeps_the_response_id_as_its_request_id(served):
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion(["solo"], n=1)).json()
    assert served.engine.submitted[-1].request_id == body["id"]


def test_chat_honours_n(served):
    with served.client() as client:
        body = client.post("/v1/chat/completions", json=_chat(_user("hi"), n=2)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert len({c["message"]["content"] for c in body["choices"]}) == 1
    rendered = len("[user] hi\n[assistant] ")
    assert body["usage"]["prompt_tokens"] == rendered
    assert body["usage"]["completion_tokens"] == 2 * (rendered + 1)


def test_best_of_equal_to_n_asks_for_nothing_more_and_is_accepted(served):
    with served.client() as client:
        body = client.post("/v1/completions", json=_completion("ok", n=2, best_of=2)).json()
    assert len(body["choices"]) == 2


def test_the_openai_client_reads_n_choices_of_a_batch(served):
    client = served.openai()
    reply = client.completions.create(model="fake-model", prompt=["one", "two"], n=2, max_tokens=8)
    assert [(c.index, c.text) for c in reply.choices] == [(0, "one"), (1, "one"), (2, "two"), (3, "two")]
    chat = client.chat.completions.create(model="fake-model", messages=_user("yo"), n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 3 * len("[user] yo\n[assistant] ") + 3


# ---------------------------------------------------------------- seeds


def test_seeds_are_derived_per_choice_and_choice_zero_keeps_the_seed(served):
    before = len(served.engine.submitted)
    with served.client() as client:
        client.post("/v1/completions", json=_completion("s", n=3, seed=1234))
        client.post("/v1/completions", json=_completion("s", n=3, seed=1234))
        client.post("/v1/completions", json=_completion("s", seed=1234))
        client.post("/v1/completions", json=_completion(["t", "s"], n=3, seed=1234))
        client.post("/v1/completions", json=_completion("s", n=2))
    seeds = [r.sampling.seed for r in served.engine.submitted[before:]]
    first, again, single, batch, unseeded = seeds[:3], seeds[3:6], seeds[6:7], seeds[7:13], seeds[13:]
    assert first == again  # seed + n is reproducible
    assert first[0] == single[0] == 1234  # choice 0 is the n=1 answer
    assert len(set(first)) == 3  # the other choices differ from it and from each other
    assert batch[:3] == batch[3:] == first  # a prompt gets the same seeds in a batch as alone
    assert unseeded == [None, None]


def test_choice_seeds_are_splitmix64_as_documented():
    # SplitMix64 from state 0: its first output is 0xE220A8397B1DCDAF (the published reference value)
    assert choice_seed(0, 1) == 0xE220A8397B1DCDAF - 2**64
    assert choice_seed(-1, 0) == -1
    seeds = {choice_seed(s, j) for s in (0, 1, -1, 2**63 - 1) for j in range(MAX_N)}
    assert len(seeds) == 4 * MAX_N and all(-(2**63) <= s < 2**63 for s in seeds)


# ---------------------------------------------------------------- streaming


def test_a_streamed_batch_tags_chunks_with_their_index_and_ends_once(served):
    chunks, events = _streamed(served, "/v1/completions", _completion(
        ["ab", "cde"], n=2, max_tokens=8, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert _texts_by_index(chunks[:-1]) == {0: "ab", 1: "ab", 2: "cde", 3: "cde"}
    assert _finishes(chunks) == {i: ["stop"] for i in range(4)}  # one finish per choice
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * 3 + 2 * 4
    assert chunks[-1]["usage"]["prompt_tokens"] == 5
    assert len({chunk["id"] for chunk in chunks}) == 1


def test_a_streamed_chat_opens_every_choice_with_the_role(served):
    chunks, _ = _streamed(served, "/v1/chat/completions", _chat(_user("hi"), n=2))
    openings = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(o["index"] for o in openings) == [0, 1]
    texts = _texts_by_index(chunks, key=lambda choice: choice["delta"].get("content"))
    assert texts[0] == texts[1] == "[user] hi\n[assistant] "


def test_the_openai_client_streams_n_choices(served):
    stream = served.openai().completions.create(model="fake-model", prompt="xy", n=2, stream=True,
                                                stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == {0: "xy", 1: "xy"} and usage.completion_tokens == 6


# ---------------------------------------------------------------- one choice failing


def test_a_failing_choice_does_not_take_the_others_down(served):
    with served.client() as client:
        response = client.post("/v1/completions", json=_completion(["fine", "!fail here"], max_tokens=20))
    assert response.status_code == 200
    good, bad = response.json()["choices"]
    assert good == {"index": 0, "text": "fine", "logprobs": None, "finish_reason": "stop"}
    assert bad["index"] == 1 and bad["finish_reason"] == "error" and bad["text"] == "!"  # what came before it failed
    assert bad["error"]["type"] == "server_error" and "fails prompts that start with !fail" in bad["error"]["message"]


def test_a_failing_choice_in_a_stream_ends_alone(served):
    chunks, events = _streamed(served, "/v1/completions", _completion(
        ["fine", "!fail here"], max_tokens=20, stream_options={"include_usage": True}))
    assert _finishes(chunks) == {0: ["stop"], 1: ["error"]}
    failed = next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] == "error")
    assert "!fail" in failed["error"]["message"]
    assert _texts_by_index(chunks[:-1])[0] == "fine"
    assert chunks[-1]["usage"]["completion_tokens"] == 5 + 1 and events.count("[DONE]") == 1


def test_when_every_choice_fails_the_response_is_the_error(served):
    with served.client() as client:
        whole = client.post("/v1/completions", json=_completion(["!fail a", "!fail b"], max_tokens=20))
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "internal_error"
    chunks, events = _streamed(served, "/v1/completions", _completion(["!fail a", "!fail b"], max_tokens=20))
    assert events[-1] == "[DONE]" and "error" in chunks[-1] and "choices" not in chunks[-1]


# ---------------------------------------------------------------- refusals and admission


def test_a_refused_choice_withdraws_the_ones_already_submitted(served):
    before = len(served.engine.submitted)
    with served.client() as client:
        response = client.post("/v1/completions", json=_completion(["fine", "!reject me"]))
    assert response.status_code == 400 and response.json()["error"]["code"] == "rejected_by_engine"
    withdrawn = served.engine.submitted[before:]
    assert len(withdrawn) == 1 and withdrawn[0].request_id in served.engine.cancelled


def test_an_n16_request_takes_sixteen_places_in_the_real_engines_waiting_line(catalog, eager):
    """``--max-waiting`` counts choices, not requests: with every program held at a gate (so nothing
    finishes), a request of one choice more than the free slots and the line hold is a 503, one that
    fits is accepted, and while it runs one more choice is a 503."""
    import threading

    gate = threading.Event()

    def program_for(graph_id):
        program = eager(graph_id)
        return lambda **named: (gate.wait(), program(**named))[1]

    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, max_waiting=3), program_for=program_for)
    room = engine.scheduler.request_slots + 3
    assert room < MAX_N, "the test needs n beyond the room"
    server = uvicorn_server(engine, ServerConfig(), log_level="warning", grace_s=0.2)

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
            body = {"model": engine.model_name, "prompt": [10, 11, 12], "max_tokens": 2, "temperature": 0}
            refused = await client.post("/v1/completions", json=body | {"n": room + 1})
            # the withdrawn choices that got a slot keep it until their frame ends (spec A6): let them go
            gate.set()
            await _until(lambda: engine.stats().requests_waiting == 0 and engine.stats().kv_pages_used == 0)
            gate.clear()
            fits = asyncio.ensure_future(client.post("/v1/completions", json=body | {"n": room}))
            await _until(lambda: engine.stats().requests_waiting + engine.stats().requests_running == room)
            one_more = await client.post("/v1/completions", json=body)
            stats = engine.stats()
            gate.set()
            return refused, one_more, stats, await fits

    try:
        with serving_in_thread(server) as url:
            refused, one_more, stats, fits = asyncio.run(main(url))
            wait_until(lambda: engine.stats().kv_pages_used == 0, "the pages to come back")
    finally:
        gate.set()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable", refused.text
    assert one_more.status_code == 503 and stats.shed_waiting_full == 2
    assert fits.status_code == 200 and len(fits.json()["choices"]) == room
    assert all(c["finish_reason"] == "length" for c in fits.json()["choices"])
    engine.pages.assert_no_leaks()


async def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------- cancellation


def test_a_client_leaving_a_stream_cancels_every_choice(slow):
    body = _completion(["a" * 300, "b" * 300], n=2, max_tokens=300, stream=True)
    with slow.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    response_id = json.loads(first.removeprefix("data: "))["id"]
    expected = {f"{response_id}-{i}" for i in range(4)}
    wait_until(lambda: expected <= set(slow.engine.cancelled), "every choice to be cancelled")
    wait_until(lambda: slow.engine.stats().requests_running == 0, "the choices to leave the engine")


def test_a_client_leaving_a_whole_response_cancels_every_choice(slow):
    with slow.client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=_completion("q" * 300, n=3, max_tokens=300),
                    timeout=httpx.Timeout(10.0, read=0.3))
    ids = {r.request_id for r in slow.engine.submitted[-3:]}
    wait_until(lambda: ids <= set(slow.engine.cancelled), "every choice to be cancelled")


# ---------------------------------------------------------------- chat echo and max_completion_tokens


def test_chat_echo_starts_the_answer_with_a_final_message_the_answer_continues(served):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    with served.client() as client:
        continued = client.post("/v1/chat/completions", json=_chat(conversation, echo=True, continue_final_message=True,
                                                                   max_tokens=60)).json()
        unopened = client.post("/v1/chat/completions", json=_chat(_user("hi"), echo=True, add_generation_prompt=False)).json()
        new_turn = client.post("/v1/chat/completions", json=_chat(_user("hi"), echo=True)).json()
        plain = client.post("/v1/chat/completions", json=_chat(_user("hi"))).json()
    # the fake echoes its prompt: "[user] hi\n[assistant] Sure, " (continued: no end of turn after it)
    assert continued["choices"][0]["message"]["content"] == "Sure, " + "[user] hi\n[assistant] Sure, "
    assert unopened["choices"][0]["message"]["content"] == "hi" + "[user] hi\n"
    # a new assistant turn continues no user message: nothing echoed, as in vLLM
    assert new_turn["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert continued["usage"]["completion_tokens"] == len("[user] hi\n[assistant] Sure, ") + 1  # echo is not output


def test_chat_echo_streams_after_the_role_for_every_choice(served):
    conversation = [{"role": "assistant", "content": "Once"}]
    chunks, _ = _streamed(served, "/v1/chat/completions", _chat(conversation, echo=True, n=2,
                                                                continue_final_message=True))
    for index in (0, 1):
        mine = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0] == {"role": "assistant", "content": ""} and mine[1] == {"content": "Once"}
    texts = _texts_by_index(chunks, key=lambda choice: choice["delta"].get("content"))
    assert texts[0] == texts[1] == "Once" + "[assistant] Once"


def test_max_completion_tokens_bounds_the_output_on_both_endpoints_and_wins_over_max_tokens(served):
    with served.client() as client:
        chat = client.post("/v1/chat/completions", json=_chat(_user("hello"), max_tokens=50,
                                                              max_completion_tokens=3)).json()
        assert served.engine.submitted[-1].max_tokens == 3
        completion = client.post("/v1/completions", json=_completion("hello", max_completion_tokens=2)).json()
        assert served.engine.submitted[-1].max_tokens == 2
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 3
    assert completion["choices"][0]["text"] == "he" and completion["choices"][0]["finish_reason"] == "length"
