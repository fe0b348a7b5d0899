"""Output logprobs and the sampling controls through the engine, against the bundled model run eagerly.

Each control is checked against an independent reference: the eager target's
next-token logits (tests/helios/eager_target.py), processed here by plain
Python the way vLLM documents the control, then argmax'd (greedy) one token at
a time. Two paths may differ only where the reference's decision was a
near-tie (tests/helios/numerics.py); logprobs agree within the model's
arithmetic tolerance. Every check runs with speculation off and adaptive: in
speculative rounds the penalties must see the drafts verified before each
position, and accepted drafts' logprobs must be the target's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest
import torch

from eager_target import next_token_logits, target_config
from engine_driver import serve
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import FinishReason, GenerationRequest, SamplingParams
from numerics import near_tie_margin, qwen3_tolerance

GREEDY = SamplingParams(temperature=0.0)
MODES = ("off", "adaptive")
REPETITIVE = "abcabcabcabc abcabc abc"
IMPORTS = "import os\nimport sys\n"  # greedy: "import unittest\n" over and over


def make_engine(catalog, eager, speculation) -> HeliosEngine:
    return HeliosEngine(catalog, EngineConfig(speculation=speculation, threads=1), program_for=eager)


def ids_of(engine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text, add_special_tokens=True))


def run(engine, *requests: GenerationRequest):
    """Each request's (text, token ids, finish reason, logprobs), served together."""
    async def one(req):
        text, ids, logprobs, reason = "", [], [], None
        async for delta in engine.submit(req):
            text += delta.text
            ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
            reason = delta.finish_reason
        return text, ids, reason, logprobs

    async def body(engine):
        return await asyncio.gather(*(one(r) for r in requests))
    return serve(engine, body)


# ---------------------------------------------------------------------------
# The reference: eager logits, processed by plain Python
# ---------------------------------------------------------------------------

Processor = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]  # (logits, prompt, output so far)


def reference_greedy(prompt: list[int], steps: int, process: Processor, stop_ids=()) -> list[int]:
    out: list[int] = []
    while len(out) < steps:
        out.append(int(process(next_token_logits([*prompt, *out]), prompt, out).argmax()))
        if out[-1] in stop_ids:
            break
    return out


def assert_follows_reference(prompt: list[int], got: list[int], process: Processor, what: str) -> None:
    """``got`` is the reference's greedy continuation, up to a near-tie at the first difference."""
    for i, token in enumerate(got):
        logits = next_token_logits([*prompt, *got[:i]])
        scores = process(logits, prompt, got[:i])
        want = int(scores.argmax())
        if want == token:
            continue
        margin = near_tie_margin(logits, qwen3_tolerance(target_config(), len(prompt) + i + 1))
        gap = float(scores[want] - scores[token])
        assert gap <= margin, f"{what}: token {i} is {token}, the reference's is {want} by {gap:.3g} (> {margin:.3g})"
        return  # a near-tie flipped: what follows depends on it


def counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab).float() if tokens else torch.zeros(vocab)


def presence(amount: float) -> Processor:
    return lambda logits, prompt, out: logits - amount * (counts(out, logits.shape[0]) > 0).float()


def frequency(amount: float) -> Processor:
    return lambda logits, prompt, out: logits - amount * counts(out, logits.shape[0])


def repetition(r: float) -> Processor:
    def process(logits, prompt, out):
        seen = counts([*prompt, *out], logits.shape[0]) > 0
        return torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return process


def unchanged(logits, prompt, out):
    return logits


# ---------------------------------------------------------------------------
# Output logprobs
# ---------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("speculation", MODES)
def test_output_logprobs_are_the_eager_targets_raw_distribution(catalog, eager, speculation):
    engine = make_engine(catalog, eager, speculation)
    prompts = [ids_of(engine, REPETITIVE), ids_of(engine, "def main():\n    return")]
    reqs = [GenerationRequest(f"l{i}", p, 16, GREEDY, logprobs=5, ignore_eos=True) for i, p in enumerate(prompts)]
    results = run(engine, *reqs)
    for prompt, (_, ids, _, logprobs) in zip(prompts, results):
        assert [lp.token_id for lp in logprobs] == ids and all(len(lp.top) == 5 for lp in logprobs)
        for i, lp in enumerate(logprobs):
            logits = next_token_logits([*prompt, *ids[:i]])
            want = logits.log_softmax(-1)
            margin = near_tie_margin(logits, qwen3_tolerance(target_config(), len(prompt) + i + 1))
            assert abs(lp.logprob - float(want[lp.token_id])) <= margin, (i, lp.logprob, float(want[lp.token_id]))
            best = want.topk(5).values
            assert [a.logprob for a in lp.top] == pytest.approx(best.tolist(), abs=margin)
            for a in lp.top:  # each alternative is the token it names
                assert abs(a.logprob - float(want[a.token_id])) <= margin
    if speculation == "adaptive":  # accepted drafts were among the tokens checked
        assert sum(t.accepted_tokens for t in engine.stats().speculative) > 0


def test_logprobs_are_reported_only_when_asked_and_trimmed_to_the_request(catalog, eager):
    engine = make_engine(catalog, eager, "off")
    prompt = ids_of(engine, "import os")
    plain, none_top = run(engine, GenerationRequest("a", prompt, 4, GREEDY),
                          GenerationRequest("b", prompt, 4, GREEDY, logprobs=0))
    assert plain[3] == [] and len(none_top[3]) == len(none_top[1]) and all(lp.top == () for lp in none_top[3])


# ---------------------------------------------------------------------------
# Logit controls in the programs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("speculation", MODES)
def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one(catalog, eager, speculation):
    engine = make_engine(catalog, eager, speculation)
    prompt = ids_of(engine, REPETITIVE)
    free = run(engine, GenerationRequest("f", prompt, 6, GREEDY))[0][1]
    forced_token = 300
    forced, banned = run(engine,
                         GenerationRequest("p", prompt, 6, SamplingParams(temperature=0.0, logit_bias=((forced_token, 100.0),))),
                         GenerationRequest("m", prompt, 6, SamplingParams(temperature=0.0, logit_bias=((free[0], -100.0),))))
    assert forced[1] == [forced_token] * 6
    assert banned[1][0] != free[0] and free[0] not in banned[1]

    def ban(logits, p, out):
        return logits.index_add(0, torch.tensor([free[0]]), torch.tensor([-100.0]))
    assert_follows_reference(list(prompt), banned[1], ban, "logit_bias -100")


@pytest.mark.parametrize("speculation", MODES)
@pytest.mark.parametrize("name, amount, process", [
    ("presence_penalty", 1.5, presence(1.5)),
    ("frequency_penalty", 0.7, frequency(0.7)),
    ("repetition_penalty", 1.8, repetition(1.8)),
], ids=["presence", "frequency", "repetition"])
def test_penalties_change_the_greedy_continuation_exactly_as_the_reference(catalog, eager, speculation, name, amount,
                                                                           process):
    engine = make_engine(catalog, eager, speculation)
    prompt = ids_of(engine, REPETITIVE)
    free, penalised = run(engine, GenerationRequest("f", prompt, 16, GREEDY, ignore_eos=True),
                          GenerationRequest("p", prompt, 16, SamplingParams(temperature=0.0, **{name: amount}),
                                            ignore_eos=True))
    assert penalised[1] != free[1], "the penalty changed nothing on a repetitive prompt: the test proves nothing"
    assert_follows_reference(list(prompt), penalised[1], process, f"{name} {amount} ({speculation})")
    assert_follows_reference(list(prompt), free[1], unchanged, f"no penalty ({speculation})")


def test_a_slots_history_starts_afresh_for_its_next_request(catalog, eager):
    """Penalties read per-slot state: a request must not see the previous occupant's tokens."""
    engine = make_engine(catalog, eager, "off")
    prompt = ids_of(engine, REPETITIVE)
    sampling = SamplingParams(temperature=0.0, presence_penalty=1.5)

    async def body(engine):
        results = []
        for rid in ("first", "second"):  # one after the other: the second reuses the first's slot
            results.append([t async for d in engine.submit(GenerationRequest(rid, prompt, 12, sampling, ignore_eos=True))
                            for t in d.token_ids])
        return results
    first, second = serve(engine, body)
    assert first == second


def test_min_p_1_keeps_only_the_most_likely_token_so_sampling_is_greedy(catalog, eager):
    engine = make_engine(catalog, eager, "adaptive")
    prompt = ids_of(engine, "class Foo(object):")
    greedy, sampled = run(engine, GenerationRequest("g", prompt, 12, GREEDY, ignore_eos=True),
                          GenerationRequest("s", prompt, 12, SamplingParams(temperature=1.5, seed=3, min_p=1.0),
                                            ignore_eos=True))
    assert sampled[1] == greedy[1]


@pytest.mark.parametrize("speculation", MODES)
def test_seeded_sampling_with_controls_does_not_depend_on_speculation(catalog, eager, speculation):
    engine = make_engine(catalog, eager, speculation)
    prompt = ids_of(engine, REPETITIVE)
    sampling = SamplingParams(temperature=0.8, seed=11, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05,
                              logit_bias=((65, 2.0),))
    got = run(engine, GenerationRequest("s", prompt, 16, sampling, ignore_eos=True))[0][1]
    reference = run(make_engine(catalog, eager, "off"), GenerationRequest("s", prompt, 16, sampling, ignore_eos=True))[0][1]
    diverged = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), None)
    assert diverged is None, f"seeded output differs at token {diverged}: {got} vs {reference}"


# ---------------------------------------------------------------------------
# End-of-sequence and stop ids
# ---------------------------------------------------------------------------


def _repeated_token(engine, prompt) -> tuple[int, int, list[int]]:
    """A token of the greedy continuation that also appears later, where it first appears, and the continuation.

    The bundled model rarely ends a continuation with an end-of-sequence token, so the tests below
    make such a token end requests instead (as stop_token_ids, or as the engine's end-of-sequence id).
    """
    out = reference_greedy(list(prompt), 16, unchanged)
    first = next(i for i, t in enumerate(out) if i >= 1 and t not in out[:i] and t in out[i + 1:])
    return out[first], first, out


@pytest.mark.parametrize("speculation", MODES)
def test_min_tokens_forbids_the_ending_ids_before_it(catalog, eager, speculation):
    engine = make_engine(catalog, eager, speculation)
    prompt = ids_of(engine, IMPORTS)
    token, first, _ = _repeated_token(engine, prompt)
    minimum = first + 3
    early, held = run(engine, GenerationRequest("e", prompt, 16, GREEDY, stop_token_ids=(token,)),
                      GenerationRequest("m", prompt, 16, GREEDY, min_tokens=minimum, stop_token_ids=(token,)))
    assert len(early[1]) == first + 1 and early[2] is FinishReason.STOP  # without min_tokens it ends at once
    assert len(held[1]) > minimum and token not in held[1][:minimum]
    banned = sorted({token, *engine.executor.eos_ids})

    def suppressed_before_minimum(logits, p, out):
        return logits.index_fill(0, torch.tensor(banned), -math.inf) if len(out) < minimum else logits
    assert_follows_reference(list(prompt), held[1], suppressed_before_minimum, "min_tokens")


def test_ignore_eos_runs_past_the_end_of_sequence_token(catalog, eager):
    engine = make_engine(catalog, eager, "off")
    prompt = ids_of(engine, IMPORTS)
    token, first, out = _repeated_token(engine, prompt)
    engine._eos = engine.executor.eos_ids = frozenset({token})  # pretend the token ends a sequence
    ended, ignored = run(engine, GenerationRequest("e", prompt, 12, GREEDY),
                         GenerationRequest("i", prompt, 12, GREEDY, ignore_eos=True))
    assert ended[1] == out[: first + 1] and ended[2] is FinishReason.STOP
    assert ignored[1] == out[:12] and ignored[2] is FinishReason.LENGTH


def test_stop_token_ids_end_the_request_and_their_text_is_kept_only_when_asked(catalog, eager):
    engine = make_engine(catalog, eager, "off")
    prompt = ids_of(engine, REPETITIVE)
    free = run(engine, GenerationRequest("f", prompt, 12, GREEDY, ignore_eos=True))[0]
    stop_at = next(i for i, t in enumerate(free[1]) if i >= 2 and engine.tokenizer.decode([t]))
    token = free[1][stop_at]
    first = free[1].index(token)
    dropped, kept = run(engine, GenerationRequest("d", prompt, 12, GREEDY, stop_token_ids=(token,)),
                        GenerationRequest("k", prompt, 12, GREEDY, stop_token_ids=(token,),
                                          include_stop_str_in_output=True))
    assert dropped[1] == kept[1] == free[1][: first + 1] and dropped[2] is kept[2] is FinishReason.STOP
    assert kept[0] == engine.tokenizer.decode(free[1][: first + 1])
    assert dropped[0] == engine.tokenizer.decode(free[1][:first])


def test_include_stop_str_in_output_keeps_the_stop_string(catalog, eager):
    engine = make_engine(catalog, eager, "off")
    prompt = ids_of(engine, REPETITIVE)
    free = run(engine, GenerationRequest("f", prompt, 12, GREEDY, ignore_eos=True))[0][0]
    stop = free.strip()[1:3] or free[:2]
    cut, kept = run(engine, GenerationRequest("c", prompt, 12, GREEDY, (stop,)),
                    GenerationRequest("k", prompt, 12, GREEDY, (stop,), include_stop_str_in_output=True))
    at = free.find(stop)
    assert cut[0] == free[:at] and kept[0] == free[: at + len(stop)]


# ---------------------------------------------------------------------------
# Scored prefill through the executor (issue 18 item 1: the program and executor parts)
# ---------------------------------------------------------------------------


@pytest.mark.numerics
def test_scored_prefill_chunks_give_every_prompt_tokens_logprob_and_alternatives():
    from flare_contract.graphs import GraphDescriptor, GraphKind
    from helios.runtime.executor import Executor, LaneContext, RowSampling, bind
    from helios.scheduler.types import LanePhase, PlannedLane, RequestHandle, ScheduledPlan, SelectionReason
    from ignition.models.programs import StateLayout, build_program
    from tiny_catalog import _named, bundled_checkpoints

    target, _ = bundled_checkpoints()
    layout = StateLayout(request_slots=2, page_size=16, num_pages=16, max_pages_per_slot=8)
    graph = GraphDescriptor("scored_p32", GraphKind.SCORED_PREFILL, 1, prefill_capacity=32)
    spec = build_program(graph, target.config, layout, target.weights)
    executor = Executor(layout.new_state(target.config), lambda _: _named(spec, spec.example_args[0]), frozenset())
    table = torch.full((2, 8), -1, dtype=torch.int32)
    table[1] = torch.arange(8, dtype=torch.int32)
    from helios.text.tokenizer import CheckpointTokenizer
    from tiny_catalog import REPO

    tokenizer = CheckpointTokenizer.from_folder(REPO / "ignition" / "models" / "bundled" / "flare-tiny" / "target")
    prompt = tuple(tokenizer.encode("def main(argv):\n    import os, sys\n    return os.getcwd() + sys.argv[0]\n",
                                    add_special_tokens=True))
    assert 24 < len(prompt) <= 48
    handle = RequestHandle(1, 1)
    scores = []
    for start, count in ((0, 24), (24, len(prompt) - 24)):  # two chunks, the second one final
        lane = PlannedLane(handle, LanePhase.PROMPT, prompt_start=start, prompt_tokens=count,
                           finishes_prompt=start + count == len(prompt))
        plan = ScheduledPlan(graph, (lane,), SelectionReason.ORDINARY, 0, 1.0, 0.0)
        context = {handle: LaneContext(RowSampling(), prompt=prompt)}
        scores.extend(executor.run(bind(plan, context, table), 0).prompt_logprobs[handle])
    assert [s.token_id for s in scores] == list(prompt[1:])  # every prompt token but the first is scored
    for i, score in enumerate(scores):
        logits = next_token_logits(list(prompt[: i + 1]))
        want = logits.log_softmax(-1)
        margin = near_tie_margin(logits, qwen3_tolerance(target_config(), i + 2))
        assert abs(score.logprob - float(want[score.token_id])) <= margin, i
        assert [a.logprob for a in score.top] == pytest.approx(want.topk(len(score.top)).values.tolist(), abs=margin)
