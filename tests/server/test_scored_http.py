"""Scored prefill over HTTP with the official ``openai`` client (issue 18 item 1; docs/http-api.md rows
``echo`` and ``prompt_logprobs``), on the real engine.

The server runs the CLI capture of the bundled model (prefill, scored prefill,
decode; ``cli_capture`` in tests/conftest.py) through eager twins of its
programs, in this process. Prompt logprobs are checked against the bundled
target run eagerly (tests/helios/eager_target.py) within twice the near-tie
margin of tests/helios/numerics.py: a logprob is a logit minus a logsumexp,
and the logsumexp moves by at most the largest logit change
(tests/helios/test_scored_prompt_engine.py derives it in full).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from eager_target import next_token_logits, target_config
from numerics import near_tie_margin, qwen3_tolerance
from server_process import serving_in_thread
from helios.catalog.load import load
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.server.app import ServerConfig
from helios.server.serve import uvicorn_server
from tiny_catalog import eager_programs

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"


@pytest.fixture(scope="module")
def served(cli_capture) -> Iterator[tuple[openai.OpenAI, HeliosEngine]]:
    catalog = load(cli_capture.folder)
    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1), program_for=eager_programs(catalog))
    with serving_in_thread(uvicorn_server(engine, ServerConfig(), log_level="warning")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120.0), engine


def ids_of(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=True)


def assert_prompt_scores(prompt: list[int], logprobs: list) -> None:
    """logprobs[i] (i >= 1) is the eager target's logprob of prompt token i after tokens 0..i-1."""
    for i in range(1, len(prompt)):
        logits = next_token_logits(prompt[:i])
        margin = 2 * near_tie_margin(logits, qwen3_tolerance(target_config(), len(prompt)))
        assert abs(logprobs[i] - float(logits.log_softmax(-1)[prompt[i]])) <= margin, i


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(served):
    client, engine = served
    prompt = ids_of(engine, PROMPT)
    reply = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True,
                                      temperature=0)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(prompt)] == [engine.tokenizer.decode([t]) for t in prompt]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs) if top is not None)
    assert_prompt_scores(prompt, lp.token_logprobs)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 1
    plain = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=1, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text  # the one generated token is what plain decoding gives


def test_echo_with_max_tokens_zero_is_the_scored_prompt_alone(served):
    client, engine = served
    prompt = ids_of(engine, PROMPT)
    reply = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    choice = reply.choices[0]
    assert choice.text == engine.tokenizer.decode(prompt) and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt) and reply.usage.completion_tokens == 0
    assert all(top is None or len(top) == 1 for top in choice.logprobs.top_logprobs)  # 0 alternatives: the token


def test_echo_without_logprobs_prefixes_the_prompt(served):
    client, engine = served
    asked = dict(model=engine.model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    plain = client.completions.create(**asked).choices[0]
    echoed = client.completions.create(echo=True, **asked).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.logprobs is None


def test_echo_streamed_brings_the_prompt_in_the_first_chunk(served):
    client, engine = served
    asked = dict(model=engine.model_name, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True, temperature=0)
    whole = client.completions.create(**asked).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **asked) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert len(chunks[0].logprobs.tokens) >= len(ids_of(engine, PROMPT))
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_a_batch_of_token_id_prompts_with_echo_answers_each_prompt(served):
    """lm-eval's loglikelihood requests: token ids, echo, logprobs 1, max_tokens 1, batch 4."""
    client, engine = served
    prompts = [ids_of(engine, PROMPT)[: 6 + 3 * i] for i in range(4)]
    reply = client.completions.create(model=engine.model_name, prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                                      temperature=0)
    for choice in sorted(reply.choices, key=lambda c: c.index):
        prompt = prompts[choice.index]
        assert len(choice.logprobs.token_logprobs) == len(prompt) + 1
        assert choice.logprobs.token_logprobs[0] is None
        assert_prompt_scores(prompt, choice.logprobs.token_logprobs[: len(prompt)])


def test_prompt_logprobs_on_completions_in_vllms_shape(served):
    client, engine = served
    prompt = ids_of(engine, PROMPT)
    choice = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2}).choices[0]
    scores = choice.model_extra["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    for i, entry in enumerate(scores[1:], start=1):
        own = entry[str(prompt[i])]
        assert list(entry)[0] == str(prompt[i]) and 2 <= len(entry) <= 3  # the token, then the 2 best
        assert own["decoded_token"] == engine.tokenizer.decode([prompt[i]])
        alternatives = [v["rank"] for v in list(entry.values())[1:]]  # the 2 best, but the token itself
        assert own["rank"] is None or 1 <= own["rank"] <= 20
        assert alternatives == [r for r in (1, 2) if r != own["rank"]]
    assert_prompt_scores(prompt, [None, *(e[str(t)]["logprob"] for e, t in zip(scores[1:], prompt[1:]))])
    assert choice.logprobs is None  # output logprobs were not asked


def test_prompt_logprobs_on_chat_sit_beside_the_choices(served):
    client, engine = served
    reply = client.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 0})
    scores = reply.model_extra["prompt_logprobs"]
    assert len(scores) == reply.usage.prompt_tokens and scores[0] is None
    assert all(len(entry) == 1 for entry in scores[1:])  # 0 alternatives: the prompt token alone
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in reply.choices)


def test_prompt_logprobs_streamed_is_refused(served):
    client, engine = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert caught.value.body["param"] == "prompt_logprobs"
