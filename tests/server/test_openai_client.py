"""The official ``openai`` client against a real ``flare run`` (the tiny slice of the bundled catalog):
the request fields whose meaning depends on the engine (issue 18; docs/http-api.md, "Request fields").

The fake-engine tests (test_http_api.py, test_choices.py) pin the shapes and
refusals; these check the same fields where the model really generates:
seeded and greedy output, several choices per request, prompt batches,
streaming, and that every choice leaves the engine.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helios"))
from server_process import start_server, wait_ready  # noqa: E402
from tiny_catalog import cache_folder, tiny_catalog_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "flare-tiny"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def base(request, tmp_path_factory):
    catalog = tiny_catalog_path(cache_folder(request.config, tmp_path_factory))
    log_path = tmp_path_factory.mktemp("flare-run-openai") / "server.log"
    process = start_server([sys.executable, "-m", "helios.cli", "run", str(catalog), "--threads", "1",
                            "--log-stats-interval", "0"], log_path, cwd=REPO)
    try:
        yield wait_ready(process, log_path, name="flare run", timeout_s=180.0)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120.0)


def _texts(reply) -> list[str]:
    return [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]


def _gauge(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


# ---------------------------------------------------------------- n and seed


def test_seed_and_n_reproduce_and_choice_zero_is_the_n1_answer(client):
    asked = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.3, seed=77)
    three = client.completions.create(n=3, **asked)
    again = client.completions.create(n=3, **asked)
    single = client.completions.create(**asked)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert _texts(three) == _texts(again)
    assert _texts(three)[0] == single.choices[0].text
    assert len(set(_texts(three))) > 1, "each choice samples with its own seed"
    assert three.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens >= 3 and three.usage.total_tokens == (
        three.usage.prompt_tokens + three.usage.completion_tokens)


def test_chat_n_is_reproducible_with_a_seed(client):
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=10,
                 temperature=1.0, seed=5, n=2)
    first, second = client.chat.completions.create(**asked), client.chat.completions.create(**asked)
    contents = [c.message.content for c in first.choices]
    assert contents == [c.message.content for c in second.choices] and len(contents) == 2


# ---------------------------------------------------------------- prompt batches


def test_a_batch_of_prompts_answers_each_as_it_would_alone(client):
    ids = client.completions.create(model=MODEL, prompt="The river", max_tokens=1).usage.prompt_tokens
    prompts = ["The lantern by the river", "Once upon a time, in a quiet harbor,", "def add(a, b):"]
    asked = dict(model=MODEL, max_tokens=10, temperature=0)
    batch = client.completions.create(prompt=prompts, **asked)
    alone = [client.completions.create(prompt=p, **asked).choices[0].text for p in prompts]
    assert _texts(batch) == alone
    assert ids >= 1 and batch.usage.prompt_tokens == sum(
        client.completions.create(prompt=p, **asked).usage.prompt_tokens for p in prompts)


def test_token_id_prompts_single_and_batched(base, client):
    tokens = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    asked = dict(model=MODEL, max_tokens=8, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **asked).choices[0].text
    assert client.completions.create(prompt=tokens, **asked).choices[0].text == by_text
    assert _texts(client.completions.create(prompt=[tokens, tokens], **asked)) == [by_text, by_text]


def test_a_streamed_batch_with_n_matches_the_whole_answer(client):
    asked = dict(model=MODEL, prompt=["Alpha beta", "Gamma delta"], n=2, max_tokens=8, temperature=0.9, seed=3)
    whole = client.completions.create(**asked)
    texts, finishes, usage, chunks = {}, {}, None, 0
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **asked):
        chunks += 1
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert [texts[i] for i in range(4)] == _texts(whole)
    assert sorted(finishes) == [0, 1, 2, 3] and chunks > 4
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_leaving_a_stream_of_several_choices_frees_every_slot_and_page(base, client):
    stream = client.completions.create(model=MODEL, prompt=["Long story one", "Long story two"], n=2,
                                       max_tokens=200, temperature=1.0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while _gauge(base, "flare_requests_running") or _gauge(base, "flare_kv_pages_used"):
        assert time.monotonic() < deadline, "the choices did not leave the engine"
        time.sleep(0.05)


# ---------------------------------------------------------------- output bounds, stop, chat controls


def test_max_completion_tokens_bounds_the_output(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on and on."}],
                                           max_completion_tokens=3, max_tokens=50, temperature=0)
    assert reply.usage.completion_tokens <= 3
    assert reply.choices[0].finish_reason == "length" or reply.usage.completion_tokens < 3


def test_stop_as_a_plain_string(client):
    reply = client.completions.create(model=MODEL, prompt="Line one\nLine two\nLine", max_tokens=40,
                                      temperature=0, stop="\n")
    assert "\n" not in reply.choices[0].text


def test_chat_echo_with_continue_final_message(client):
    messages = [{"role": "user", "content": "Write a line."}, {"role": "assistant", "content": "The sea is"}]
    asked = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(extra_body={"continue_final_message": True}, **asked)
    echoed = client.chat.completions.create(extra_body={"continue_final_message": True, "echo": True}, **asked)
    assert echoed.choices[0].message.content == "The sea is" + plain.choices[0].message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens


# ---------------------------------------------------------------- refusals the client sees


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 17}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
])
def test_fields_not_honoured_are_a_bad_request_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **extra)
    assert refused.value.body["param"] == param
