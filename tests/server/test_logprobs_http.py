"""Logprobs and sampling controls over HTTP with the official ``openai`` client, on the real engine.

The server runs the tiny slice of the bundled catalog (eager twins of its
programs, speculation adaptive) in this process. Greedy continuations are
checked against the bundled model run eagerly (tests/helios/eager_target.py):
the same token strings, up to a near-tie, and logprobs within the model's
arithmetic tolerance (tests/helios/numerics.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from eager_target import next_token_logits, target_config
from numerics import near_tie_margin, qwen3_tolerance
from server_process import serving_in_thread
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.server.app import ServerConfig
from helios.server.serve import uvicorn_server

PROMPT = "import os\nimport sys\n"


@pytest.fixture(scope="module")
def served(catalog, eager) -> Iterator[tuple[openai.OpenAI, HeliosEngine]]:
    engine = HeliosEngine(catalog, EngineConfig(speculation="adaptive", threads=1), program_for=eager)
    with serving_in_thread(uvicorn_server(engine, ServerConfig(), log_level="warning")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60.0), engine


def check_against_eager(engine, prompt_ids, tokens: list[str], logprobs: list[float], tops: list[dict]) -> None:
    """Each position: the eager target's greedy token string and logprob, its best alternatives named."""
    ids: list[int] = []
    for i, (text, logprob, top) in enumerate(zip(tokens, logprobs, tops)):
        logits = next_token_logits([*prompt_ids, *ids])
        margin = near_tie_margin(logits, qwen3_tolerance(target_config(), len(prompt_ids) + i + 1))
        want = logits.log_softmax(-1)
        best = int(logits.argmax())
        if engine.tokenizer.decode([best]) != text:
            runner_up = max(float(logits[t]) for t in range(len(logits)) if engine.tokenizer.decode([t]) == text)
            assert float(logits[best]) - runner_up <= margin, f"token {i}: {text!r}, eager prefers {best}"
            return  # a near-tie flipped; what follows depends on it
        assert abs(logprob - float(want[best])) <= margin
        for alternative, value in top.items():  # every named alternative has its eager logprob
            assert any(abs(value - float(want[t])) <= margin for t in range(len(want))
                       if engine.tokenizer.decode([t]) == alternative), (i, alternative, value)
        ids.append(best)


def test_completion_logprobs_whole_and_streamed(served):
    client, engine = served
    args = dict(model=engine.model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == whole.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(3 <= len(top) <= 4 and token in top for token, top in zip(lp.tokens, lp.top_logprobs))
    check_against_eager(engine, engine.tokenizer.encode(PROMPT, add_special_tokens=True), lp.tokens,
                        lp.token_logprobs, lp.top_logprobs)
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset  # offsets run on across chunks
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-3)


def test_chat_logprobs_whole_and_streamed(served):
    client, engine = served
    args = dict(model=engine.model_name, messages=[{"role": "user", "content": "import os"}], max_tokens=6,
                temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == whole.message.content
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)  # greedy
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    without = client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None}).choices[0]
    assert without.logprobs is None


def test_controls_over_http_do_what_they_say(served):
    client, engine = served
    forced = engine.tokenizer.decode([300])
    biased = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"300": 100})
    assert biased.choices[0].text == forced * 4
    free = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    penalised = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                          presence_penalty=2.0, extra_body={"ignore_eos": True}).choices[0].text
    assert penalised != free
    stop = client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop="\n",
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert stop.text == free[: free.index("\n") + 1] and stop.finish_reason == "stop"


def test_refused_values_name_their_field(served):
    client, engine = served
    for extra, field in (({"logprobs": 21}, "logprobs"), ({"extra_body": {"min_tokens": 3}, "stop": "x"}, "min_tokens"),
                         ({"logit_bias": {"99999": 1}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=4, **extra)
        assert error.value.body["param"] == field, error.value.body
