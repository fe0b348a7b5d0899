"""Admission limits of the real engine (issue 17, parts 4 and 5).

- the waiting line is bounded: beyond ``max_waiting`` requests without a slot,
  ``submit`` refuses at once with ``EngineOverloaded`` (a 503 with Retry-After);
- a request that waits longer than ``queue_timeout_s`` for a slot ends with
  ``QueueTimeout`` while the running ones are unaffected;
- the checkpoint tokenizer's ``max_token_bytes`` is a true bound, so text
  refused for its length alone could never have fit.

Slots are held deterministically: every program call waits on a gate the
test opens, so the requests that got slots cannot finish until then.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import EngineOverloaded, GenerationRequest, QueueTimeout, SamplingParams, fewest_tokens
from helios.server.serve import body_limit
from helios.text.tokenizer import CheckpointTokenizer, max_token_bytes
from helios.runtime.waiting import WaitingLine

GREEDY = SamplingParams(temperature=0.0)
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[2] / "ignition/models/bundled/flare-tiny/target"


def gated(eager):
    """``program_for`` whose programs all wait until ``gate`` is set, and the gate."""
    gate = threading.Event()

    def program_for(graph_id):
        program = eager(graph_id)

        def call(**named):
            gate.wait()
            return program(**named)
        return call

    return program_for, gate


def run(engine: HeliosEngine, gate: threading.Event, body):
    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), 120)
        finally:
            gate.set()  # whatever happened, let the device worker finish so the engine can stop
            await engine.stop()
    return asyncio.run(main())


def request(rid: str, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(rid, (10, 11, 12, 13), max_tokens, GREEDY)


async def drain(stream) -> list:
    return [delta async for delta in stream]


async def until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_the_waiting_line_counts_a_submission_before_the_control_thread_sees_it():
    line: WaitingLine[str] = WaitingLine(limit=2)
    line.reserve()
    line.reserve()
    with pytest.raises(EngineOverloaded, match="2 requests are already waiting") as refused:
        line.reserve()
    assert refused.value.retry_after_s == 1 and line.refused == 1
    line.append("a", now=0.0)
    assert line.popleft() == "a" and line.waiting() == 1
    line.reserve()  # room again once one left the line
    assert line.waiting() == 2
    line.reserve(free_slots=1)  # one more may come while a slot is free for it
    with pytest.raises(EngineOverloaded):
        line.reserve(free_slots=1)


def test_a_full_waiting_line_refuses_at_submit_and_drains_normally(catalog, eager):
    program_for, gate = gated(eager)
    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, max_waiting=2), program_for=program_for)
    slots = engine.scheduler.request_slots

    async def body(engine):
        running = [asyncio.ensure_future(drain(engine.submit(request(f"run{i}")))) for i in range(slots)]
        await until(lambda: engine.stats().requests_running == slots, "every slot to be taken")
        waiting = [asyncio.ensure_future(drain(engine.submit(request(f"wait{i}")))) for i in range(2)]
        with pytest.raises(EngineOverloaded, match="2 requests are already waiting for a slot") as refused:
            engine.submit(request("one-too-many"))
        stats = engine.stats()
        gate.set()
        finished = await asyncio.gather(*running, *waiting)
        later = await drain(engine.submit(request("later")))
        return refused.value, stats, finished, later, engine.stats()

    refused, stats, finished, later, after = run(engine, gate, body)
    assert refused.retry_after_s == 1
    assert stats.requests_waiting == 2 and stats.shed_waiting_full == 1
    assert len(finished) == slots + 2 and all(deltas[-1].finish_reason is not None for deltas in finished)
    assert later[-1].finish_reason is not None
    assert after.shed_waiting_full == 1 and after.requests_waiting == 0
    engine.pages.assert_no_leaks()


def test_a_request_waiting_past_the_queue_timeout_fails_alone(catalog, eager):
    program_for, gate = gated(eager)
    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, queue_timeout_s=0.05),
                          program_for=program_for)
    slots = engine.scheduler.request_slots

    async def body(engine):
        running = [asyncio.ensure_future(drain(engine.submit(request(f"run{i}", 6)))) for i in range(slots)]
        await until(lambda: engine.stats().requests_running == slots, "every slot to be taken")
        with pytest.raises(QueueTimeout, match="waited 0.05 s for a free slot") as expired:
            await drain(engine.submit(request("late")))
        stats = engine.stats()
        gate.set()
        return expired.value, stats, await asyncio.gather(*running)

    expired, stats, finished = run(engine, gate, body)
    assert expired.retry_after_s == 1
    assert stats.shed_queue_timeout == 1 and stats.requests_waiting == 0
    assert len(finished) == slots and all(deltas[-1].finish_reason is not None for deltas in finished)
    engine.pages.assert_no_leaks()


def test_config_refuses_a_nonsense_line():
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        WaitingLine(limit=0)
    with pytest.raises(ValueError, match="queue_timeout_s must be None"):
        WaitingLine(timeout_s=float("inf"))


# ---------------------------------------------------------------- the tokenizer's length bound


def test_the_bundled_tokenizer_never_gives_fewer_tokens_than_its_length_bound():
    tokenizer = CheckpointTokenizer.from_folder(BUNDLED_TOKENIZER)
    vocab = json.loads((BUNDLED_TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"]
    assert tokenizer.max_token_bytes == max(len(token) for token in vocab)  # byte-level: one character per byte
    rng = random.Random(7)
    longest = max(vocab, key=len)
    texts = [longest.replace("Ġ", " ").replace("Ċ", "\n") * 40, " " * 3000, "=" * 999, "<|im_start|>" * 50,
             "".join(chr(c) for c in rng.sample(range(32, 0x30000), 4000) if not 0xD800 <= c < 0xE000),
             "".join(rng.choice(["the ", "engine", "\n", "    ", "é", "日本"]) for _ in range(3000))]
    for text in texts:
        assert len(tokenizer.encode(text, add_special_tokens=True)) >= fewest_tokens(tokenizer, text) > 0


def _spec(tokenizer: Tokenizer) -> dict:
    return json.loads(tokenizer.to_str())


def test_tokenizers_that_may_delete_text_give_no_length_bound():
    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    assert max_token_bytes(_spec(bpe)) == 2
    bpe.normalizer = normalizers.NFKC()  # may shrink UTF-8 fourfold, never delete
    assert max_token_bytes(_spec(bpe)) == 8
    bpe.normalizer = normalizers.Strip()  # "   " -> ""
    assert max_token_bytes(_spec(bpe)) is None
    bpe.normalizer = None
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace
    assert max_token_bytes(_spec(bpe)) is None
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))  # one [UNK] per word
    assert max_token_bytes(_spec(word_level)) is None
    bpe.pre_tokenizer = None
    bpe.enable_truncation(8)
    assert max_token_bytes(_spec(bpe)) is None


def test_a_prompt_that_fits_the_context_fits_the_body_limit():
    tokenizer = CheckpointTokenizer.from_folder(BUNDLED_TOKENIZER)
    context = 4096
    vocab = json.loads((BUNDLED_TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"]
    longest = max(vocab, key=len).replace("Ġ", " ").replace("Ċ", "\n")
    prompt = longest * (context - 2)
    assert len(tokenizer.encode(prompt, add_special_tokens=True)) < context
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    assert len(body) <= body_limit(context, tokenizer.max_token_bytes) < 4 * 1024 * 1024
