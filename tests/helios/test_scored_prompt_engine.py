"""Scored prefill end to end through the engine (spec C1; issue 18 items 1 and 2), against transformers.

The catalog is the CLI capture of the bundled model (prefill, scored prefill at
64 tokens, decode; ``cli_capture`` in tests/conftest.py), run through eager
twins of its programs. A prompt of more than two chunks is scored, and every
prompt token's logprob and top alternatives are compared with the bundled
target run eagerly in Hugging Face transformers over the whole prompt at once.

Tolerance (tests/helios/numerics.py): ``qwen3_tolerance(config, n)`` bounds the
relative error of one path's logits for a context of ``n`` tokens (the
reduction lengths along a Qwen3 forward's longest dependent chain), so two
paths' logits differ by at most ``near_tie_margin`` = 2 x tolerance x max|logit|.
A logprob is logit - logsumexp(logits); logsumexp moves by at most the largest
logit change (it is a smooth maximum: its gradient is a probability vector),
so two paths' logprobs differ by at most twice that margin.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from eager_target import target_config
from engine_driver import serve, wait_idle
from helios.catalog.load import load
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import FinishReason, GenerationRequest, SamplingParams
from numerics import near_tie_margin, qwen3_tolerance
from tiny_catalog import REPO, eager_programs

transformers = pytest.importorskip("transformers")

BUNDLED_TARGET = REPO / "ignition" / "models" / "bundled" / "flare-tiny" / "target"
GREEDY = SamplingParams(temperature=0.0)
TEXT = ("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every argument, one per line.\"\"\"\n"
        "    for index, value in enumerate(argv):\n        print(index, value, os.getcwd())\n"
        "    return 0\n\n\nif __name__ == \"__main__\":\n    sys.exit(main(sys.argv))\n")


@pytest.fixture(scope="module")
def engine(cli_capture):
    catalog = load(cli_capture.folder)
    return HeliosEngine(catalog, EngineConfig(speculation="off", threads=1), program_for=eager_programs(catalog))


@pytest.fixture(scope="module")
def reference():
    model = transformers.Qwen3ForCausalLM.from_pretrained(BUNDLED_TARGET, torch_dtype=torch.float32).eval()

    def logits(ids: tuple[int, ...], vocab: int) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, :, :vocab].float()
    return logits


def run(engine, *requests):
    """Each request's deltas, served together."""
    async def one(request):
        return [delta async for delta in engine.submit(request)]

    async def body(_):
        return await asyncio.gather(*(one(r) for r in requests))
    return serve(engine, body)


@pytest.mark.numerics
def test_C1_prompt_scores_across_chunks_equal_transformers_within_the_derived_tolerance(engine, reference):
    prompt = tuple(engine.tokenizer.encode(TEXT + TEXT.replace("main", "run"), add_special_tokens=True))
    chunk = max(g.prefill_capacity for g in engine.scheduler.graphs if g.kind.value == "scored_prefill")
    assert len(prompt) > 2 * chunk, "the prompt spans three scored chunks"
    (deltas,) = run(engine, GenerationRequest("s", prompt, 0, GREEDY, prompt_logprobs=5))
    assert len(deltas) == 1 and deltas[0].finish_reason is FinishReason.LENGTH and deltas[0].token_ids == ()
    scores = deltas[0].prompt_logprobs
    assert len(scores) == len(prompt) and scores[0] is None
    assert [s.token_id for s in scores[1:]] == list(prompt[1:])
    logits_of = reference
    vocab = engine.tokenizer.vocab_size
    logits = logits_of(prompt, vocab)
    tolerance = qwen3_tolerance(target_config(), len(prompt))  # the same model's dimensions
    for i, score in enumerate(scores[1:]):
        want = logits[i].log_softmax(-1)
        margin = 2 * near_tie_margin(logits[i], tolerance)
        assert abs(score.logprob - float(want[score.token_id])) <= margin, (i, score.logprob, float(want[score.token_id]))
        assert len(score.top) == 5
        assert [a.logprob for a in score.top] == pytest.approx(want.topk(5).values.tolist(), abs=margin), i
        for a in score.top:  # each alternative is that token's logprob (ids may swap only at near-ties)
            assert abs(a.logprob - float(want[a.token_id])) <= margin, (i, a)
    wait_idle(engine)


def test_C1_generation_follows_a_scored_prompt_and_scores_come_once_on_the_first_delta(engine):
    prompt = tuple(engine.tokenizer.encode(TEXT[:120], add_special_tokens=True))
    plain, scored = run(engine, GenerationRequest("p", prompt, 6, GREEDY, ignore_eos=True),
                        GenerationRequest("q", prompt, 6, GREEDY, ignore_eos=True, prompt_logprobs=0, logprobs=0))
    assert [t for d in scored for t in d.token_ids] == [t for d in plain for t in d.token_ids]  # same greedy output
    assert len(scored[0].prompt_logprobs) == len(prompt) and all(not d.prompt_logprobs for d in scored[1:])
    assert all(s.top == () for s in scored[0].prompt_logprobs[1:])  # 0 alternatives asked
    assert all(not d.prompt_logprobs for d in plain)
    frames = engine.frame_counters().executions
    assert any(kind == "scored_prefill" for kind, _ in frames) and any(kind == "prefill" for kind, _ in frames)
    wait_idle(engine)
