"""Program kinds against the plain model, and the export -> save -> load round trip.

Spec ids: C1 (prefill, scored prefill, decode, speculative, mixed kinds),
C4 (explicit B/W/P shapes), C14 (mixed input contract: prefill_row, prefix-sum
offsets independent of slots, inactive rows and unused capacity mutate
nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flare_contract.graphs import GraphDescriptor, GraphKind
from ignition.models.programs import ProgramSpec, StateLayout, build_program
from ignition.models.qwen3 import PagedBatch, Qwen3, Qwen3Config
from ignition.models.sampling import exponential_noise, filter_top_k_top_p, sample
from numerics import assert_close_paths, assert_states_close, assert_tokens_match, qwen3_tolerance, recorded_decisions
from speculation_harness import row_columns

CONFIG = Qwen3Config(
    vocab_size=72, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
    tie_word_embeddings=False, output_vocab_size=66,
)
LAYOUT = StateLayout(request_slots=4, page_size=4, num_pages=48, max_pages_per_slot=10)
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0, seed=0)
SAMPLED = dict(temperature=0.9, top_k=30, top_p=0.95, seed=1234567890123)
# Two paths through this model (exported and eager, batched and single) agree within this
# fraction of the values' scale: the reordering bound of its longest chain (tests/helios/numerics.py).
TOLERANCE = qwen3_tolerance(CONFIG, LAYOUT.max_pages_per_slot * LAYOUT.page_size)

PREFILL = GraphDescriptor("prefill-16", GraphKind.PREFILL, 1, prefill_capacity=16)
SCORED = GraphDescriptor("scored-16", GraphKind.SCORED_PREFILL, 1, prefill_capacity=16)
DECODE1 = GraphDescriptor("decode-1", GraphKind.DECODE, 1)
DECODE4 = GraphDescriptor("decode-4", GraphKind.DECODE, 4)
SPEC_RECT = GraphDescriptor("spec-2x4", GraphKind.SPECULATIVE, 2, proposal_depth=3, width=4)
SPEC_RAGGED = GraphDescriptor("spec-4x4-p8", GraphKind.SPECULATIVE, 4, proposal_depth=3, width=4, aggregate=8,
                              ragged=True)
MIXED = GraphDescriptor("mixed-4x3-16", GraphKind.MIXED, 4, width=3, prefill_capacity=16)
MIXED1 = GraphDescriptor("mixed-2x1-16", GraphKind.MIXED, 2, width=1, prefill_capacity=16, speculation_enabled=True)
ALL = (PREFILL, SCORED, DECODE1, DECODE4, SPEC_RECT, SPEC_RAGGED, MIXED, MIXED1)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * (0.3 if len(s) > 1 else 1.0) + (len(s) == 1)
            for k, s in CONFIG.weight_shapes().items()}


WEIGHTS = _weights()
MODEL = Qwen3(CONFIG)


def reference_logits(tokens: list[int]) -> torch.Tensor:
    """Plain full-sequence forward of one sequence in a fresh cache: logits [n, sampled vocab]."""
    state = LAYOUT.new_state(CONFIG)
    one = torch.ones(1, dtype=torch.int32)
    table = torch.arange(LAYOUT.max_pages_per_slot, dtype=torch.int32)[None].expand(LAYOUT.request_slots, -1)
    batch = PagedBatch(table.contiguous(), one * 0, one * len(tokens), one * 0)
    hidden = MODEL(WEIGHTS, torch.tensor(tokens), torch.arange(len(tokens)), batch, state["k_cache"], state["v_cache"])
    return MODEL.logits(WEIGHTS, hidden)[:, : CONFIG.sampled_vocab_size]


def reference_sample(logits: torch.Tensor, position: int, params: dict) -> int:
    """What the programs' sampler gives for one logits row producing ``position``."""
    p = {k: torch.tensor([v]) for k, v in params.items()}
    return int(sample(logits[None, None], p["temperature"].float(), p["top_k"].int(), p["top_p"].float(),
                      p["seed"].long(), torch.tensor([[position]]))[0, 0])


def reference_generate(prompt: list[int], steps: int, params: dict) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(reference_sample(reference_logits(seq)[-1], len(seq), params))
    return seq[len(prompt):]


@dataclass
class Harness:
    """Persistent state plus a page table, as the runtime would hold them."""

    state: dict = field(default_factory=lambda: LAYOUT.new_state(CONFIG))
    page_table: torch.Tensor = field(default_factory=lambda: torch.randperm(
        LAYOUT.num_pages, generator=torch.Generator().manual_seed(5))[:40].view(4, 10).int())

    def run(self, spec: ProgramSpec, module=None, rows: list[dict] = (), **extra) -> dict:
        """Call a program with per-row settings (slot, length, sampling) and extra inputs."""
        args = [WEIGHTS]
        frame = self._frame(spec, list(rows), extra)
        for name in spec.input_names[1:]:
            args.append(self.state[name] if name in self.state else frame[name])
        outputs = (module or spec.module)(*args)
        return dict(zip(spec.output_names, outputs, strict=True))

    def _frame(self, spec: ProgramSpec, rows: list[dict], extra: dict) -> dict:
        shapes = {s.name: s for s in spec.inputs}
        frame = {"page_table": self.page_table, **row_columns(shapes["row_slots"].shape[0], rows)}
        for name, spec_ in shapes.items():
            if name not in frame and name not in self.state:
                frame[name] = torch.as_tensor(extra[name], dtype=spec_.dtype) if name in extra else (
                    torch.full(spec_.shape, -1, dtype=spec_.dtype) if name == "prefill_row"
                    else torch.zeros(spec_.shape, dtype=spec_.dtype))
        return frame

    def prefill(self, slot: int, prompt: list[int], params: dict, start: int = 0, final: bool = True) -> dict:
        spec = build_program(PREFILL, CONFIG, LAYOUT, WEIGHTS)
        tokens = torch.zeros(16, dtype=torch.int64)
        tokens[: len(prompt)] = torch.tensor(prompt)
        return self.run(spec, rows=[dict(slot=slot, length=len(prompt), **params)], prompt_tokens=tokens,
                        prompt_start=[start], prompt_final=[final])


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG.sampled_vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.numerics
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_C1_prefill_then_decode_equals_plain_forward(params):
    h, prompt = Harness(), _prompt(11, 1)
    want = reference_generate(prompt, 5, params)
    out = h.prefill(2, prompt, params)
    assert out["num_tokens"].tolist() == [1] and out["tokens"].tolist() == [[want[0]]]
    assert int(h.state["pending"][2]) == want[0] and int(h.state["seq_lens"][2]) == 11
    decode = build_program(DECODE4, CONFIG, LAYOUT, WEIGHTS)
    got = []
    for _ in range(4):  # the host never feeds tokens back: pending carries them
        out = h.run(decode, rows=[dict(slot=0, length=0), dict(slot=2, length=1, **params)])
        assert out["num_tokens"].tolist() == [0, 1, 0, 0]
        got.append(int(out["tokens"][1, 0]))
    assert got == want[1:]
    assert int(h.state["seq_lens"][2]) == 15 and int(h.state["pending"][2]) == want[-1]


def test_chunked_prefill_equals_one_chunk():
    prompt = _prompt(14, 2)
    one, two = Harness(), Harness()
    first = one.prefill(1, prompt, SAMPLED)
    pending_before = two.state["pending"].clone()
    partial = two.prefill(1, prompt[:9], SAMPLED, final=False)
    assert partial["num_tokens"].tolist() == [0] and partial["tokens"].tolist() == [[0]]
    assert torch.equal(two.state["pending"], pending_before), "a non-final chunk publishes no token"
    assert int(two.state["seq_lens"][1]) == 9
    last = two.prefill(1, prompt[9:], SAMPLED, start=9)
    assert last["tokens"].tolist() == first["tokens"].tolist()
    assert torch.equal(one.state["seq_lens"], two.state["seq_lens"])


@pytest.mark.numerics
def test_C1_scored_prefill_logprobs_equal_plain_log_softmax():
    h, prompt = Harness(), _prompt(12, 3)
    spec = build_program(SCORED, CONFIG, LAYOUT, WEIGHTS)
    full = reference_logits(prompt).log_softmax(-1)
    chunk = torch.zeros(16, dtype=torch.int64)
    chunk[:7] = torch.tensor(prompt[:7])
    out = h.run(spec, rows=[dict(slot=3, length=7)], prompt_tokens=chunk, prompt_start=[0],
                prompt_final=[False], next_prompt_token=[prompt[7]])
    want = full[torch.arange(7), torch.tensor(prompt[1:8])]
    assert_close_paths(out["logprobs"][:7], want, TOLERANCE, "scored logprobs")
    assert torch.all(out["logprobs"][7:] == 0)
    top = out["prompt_top_logprobs"][:7]  # the best alternatives at each prompt position, most likely first
    assert_close_paths(top, full[:7].topk(top.shape[1]).values, TOLERANCE, "prompt top logprobs")
    assert_close_paths(full[:7].gather(1, out["prompt_top_token_ids"][:7]), top, TOLERANCE, "named alternatives")
    assert torch.all(out["prompt_top_logprobs"][7:] == 0)


def _drafts(continuation: list[int], wrong_at: int | None, width: int) -> list[int]:
    drafts = list(continuation[: width - 1])
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % CONFIG.sampled_vocab_size
    return drafts


@pytest.mark.parametrize("desc", [SPEC_RECT, SPEC_RAGGED], ids=["rectangular", "ragged"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_C4_speculative_verification_commits_exactly_what_decode_would(desc, params):
    """Whatever the drafts, committed tokens equal plain sequential decoding."""
    h = Harness()
    prompts = {0: _prompt(6, 4), 3: _prompt(9, 5)}
    want = {slot: reference_generate(p, 12, params) for slot, p in prompts.items()}
    for slot, p in prompts.items():
        h.prefill(slot, p, params)
    spec = build_program(desc, CONFIG, LAYOUT, WEIGHTS)
    got = {0: [want[0][0]], 3: [want[3][0]]}
    # Row lengths (ragged: P = 8 < B * W) and where the drafts go wrong, per round.
    rounds = [((4, 3), (None, 1)), ((2, 4), (0, None)), ((4, 1), (2, None))]
    for lengths, wrong in rounds:
        rows, drafts = [], torch.zeros(desc.batch_capacity, 3, dtype=torch.int64)
        for r, (slot, length, bad) in enumerate(zip((3, 0), lengths, wrong)):
            done = len(got[slot])
            rows.append(dict(slot=slot, length=length, **params))
            d = _drafts(want[slot][done:], bad if bad is not None and bad < length - 1 else None, 4)
            drafts[r, : length - 1] = torch.tensor(d[: length - 1], dtype=torch.int64)
        out = h.run(spec, rows=rows, draft_tokens=drafts)
        for r, slot in enumerate((3, 0)):
            n = int(out["num_tokens"][r])
            bad = wrong[r] if wrong[r] is not None and wrong[r] < lengths[r] - 1 else None
            assert n == (lengths[r] if bad is None else bad + 1)
            got[slot] += out["tokens"][r, :n].tolist()
            assert torch.all(out["tokens"][r, n:] == 0)
    for slot in got:
        assert got[slot] == want[slot][: len(got[slot])]
        assert int(h.state["seq_lens"][slot]) == len(prompts[slot]) + len(got[slot]) - 1
        assert int(h.state["pending"][slot]) == got[slot][-1]


@pytest.mark.numerics
@pytest.mark.parametrize("desc", [MIXED, MIXED1], ids=["width3", "width1"])
def test_C14_mixed_frame_equals_separate_prefill_and_verification(desc):
    """Prompt row in the middle of the lane list; offsets are prefix sums, not slots."""
    params = SAMPLED
    decoding, prompt = _prompt(7, 6), _prompt(10, 7)
    want_decode = reference_generate(decoding, 4, params)
    want_prompt = reference_generate(prompt, 1, params)
    h = Harness()
    h.prefill(3, decoding, params)
    before = {k: v.clone() for k, v in h.state.items()}
    width = desc.width
    chunk = torch.zeros(16, dtype=torch.int64)
    chunk[:10] = torch.tensor(prompt)
    drafts = torch.zeros(desc.batch_capacity, width - 1, dtype=torch.int64)
    drafts[0] = torch.tensor(want_decode[1:width])
    rows = [dict(slot=3, length=width, **params), dict(slot=1, length=10, **params)]
    out = h.run(build_program(desc, CONFIG, LAYOUT, WEIGHTS), rows=rows, prefill_row=[1], prompt_tokens=chunk,
                prompt_start=[0], prompt_final=[True], draft_tokens=drafts)
    assert out["num_tokens"].tolist()[:2] == [width, 1]
    assert out["tokens"][0].tolist() == want_decode[1 : width + 1]
    assert out["tokens"][1].tolist() == [want_prompt[0]] + [0] * (width - 1)
    assert h.state["seq_lens"].tolist() == [0, 10, 0, 7 + width]
    for slot in (0, 2):  # untouched slots: state and cache pages unchanged
        pages = h.page_table[slot].long()
        assert torch.equal(h.state["k_cache"][:, pages], before["k_cache"][:, pages])
        assert int(h.state["pending"][slot]) == 0


def test_C14_inactive_rows_and_unused_capacity_mutate_nothing():
    h = Harness()
    for slot in range(4):
        h.prefill(slot, _prompt(5 + slot, slot), SAMPLED)
    before = {k: v.clone() for k, v in h.state.items()}
    for desc in (DECODE4, SPEC_RAGGED, MIXED):
        spec = build_program(desc, CONFIG, LAYOUT, WEIGHTS)
        out = h.run(spec, rows=[dict(slot=s, length=0) for s in (2, 2, 1, 0)],
                    draft_tokens=torch.ones(4, desc.width - 1, dtype=torch.int64))
        assert out["num_tokens"].tolist() == [0] * 4 and not out["tokens"].any()
    for name, tensor in h.state.items():
        assert torch.equal(tensor, before[name]), name


def test_sampling_is_a_function_of_seed_and_position_not_cohort():
    """Same request, same seed: alone at B=1 or in a busy B=4 cohort at another row/slot."""
    prompt = _prompt(8, 9)
    alone, crowd = Harness(), Harness()
    alone.prefill(0, prompt, SAMPLED)
    crowd.prefill(2, prompt, SAMPLED)
    others = [dict(SAMPLED, seed=s) for s in (7, 8)]
    crowd.prefill(0, _prompt(5, 10), others[0])
    crowd.prefill(3, _prompt(12, 11), others[1])
    d1, d4 = build_program(DECODE1, CONFIG, LAYOUT, WEIGHTS), build_program(DECODE4, CONFIG, LAYOUT, WEIGHTS)
    a, b = [], []
    for _ in range(6):
        a.append(int(alone.run(d1, rows=[dict(slot=0, length=1, **SAMPLED)])["tokens"][0, 0]))
        rows = [dict(slot=3, length=1, **others[1]), dict(slot=0, length=1, **others[0]),
                dict(slot=2, length=1, **SAMPLED)]
        b.append(int(crowd.run(d4, rows=rows)["tokens"][2, 0]))
    assert a == b
    # A different seed gives a different stream (the noise really depends on it).
    c = Harness()
    c.prefill(0, prompt, dict(SAMPLED, seed=99))
    other = [int(c.run(d1, rows=[dict(slot=0, length=1, **dict(SAMPLED, seed=99))])["tokens"][0, 0]) for _ in range(6)]
    assert other != a


def test_top_k_one_is_greedy_and_samples_stay_in_the_top_k():
    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6).view(3, 2)
    ones = torch.ones(3)
    greedy = sample(logits, ones * 0, ones.int() * 0, ones, torch.arange(3), positions)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(sample(logits, ones, ones.int(), ones, torch.arange(3), positions), greedy)
    top5 = logits.topk(5, dim=-1).indices
    for seed in range(20):
        drawn = sample(logits, ones * 2, ones.int() * 5, ones, torch.full((3,), seed), positions)
        assert (top5 == drawn[..., None]).any(-1).all()


def test_greedy_rows_beside_sampled_ones_change_no_draw():
    """A frame mixing greedy and sampled rows: each sampled row's token is its exponential-race draw from its own
    filtered distribution (temperature, top-k, top-p, min-p), as it is alone in a frame, and each greedy row takes
    the argmax. (Greedy rows reach the filter's sort as a constant row; that must not leak into a sampled row.)"""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 2, 64, generator=gen) * 3
    positions = torch.arange(10).view(5, 2) + 40
    temperature = torch.tensor([0.0, 0.8, 0.0, 1.3, 2.0])
    top_k, top_p = torch.tensor([0, 0, 3, 7, 0], dtype=torch.int32), torch.tensor([1.0, 0.9, 1.0, 0.95, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05])
    for seed in range(8):
        seeds = torch.arange(5) * 1000 + seed
        got = sample(logits, temperature, top_k, top_p, seeds, positions, min_p)
        for b in range(5):
            if temperature[b] == 0:
                assert torch.equal(got[b], logits[b].argmax(-1)), f"greedy row {b}"
                continue
            one = slice(b, b + 1)
            probs = filter_top_k_top_p(logits[one] / temperature[one, None, None], top_k[one], top_p[one],
                                       min_p[one]).softmax(-1)
            want = (probs / exponential_noise(seeds[one], positions[one], 64)).argmax(-1)[0]
            assert torch.equal(got[b], want), f"sampled row {b}, seed {seed}"
            alone = sample(logits[one], temperature[one], top_k[one], top_p[one], seeds[one], positions[one], min_p[one])
            assert torch.equal(alone[0], got[b]), f"sampled row {b} alone"


def test_padded_vocabulary_ids_are_never_produced():
    logits = torch.zeros(1, 1, 10)
    logits[..., 8:] = 100.0  # ids past output_vocab_size would win if not sliced off
    h = Harness()
    h.prefill(0, _prompt(3, 12), GREEDY)
    out = h.run(build_program(DECODE1, CONFIG, LAYOUT, WEIGHTS), rows=[dict(slot=0, length=1, temperature=5.0, seed=3)])
    assert int(out["tokens"][0, 0]) < CONFIG.sampled_vocab_size


def _state_after(desc, module, spec, setup_seed: int):
    h = Harness()
    for slot in range(4):
        h.prefill(slot, _prompt(4 + 2 * slot, setup_seed + slot), SAMPLED)
    chunk = torch.tensor(_prompt(16, 40))
    rows = [dict(slot=s, length=min(desc.width, 2) if desc.prefill_capacity == 0 or i != 1 else 9, **SAMPLED)
            for i, s in enumerate((1, 3, 0, 2)[: desc.batch_capacity])]
    if desc.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        rows = [dict(slot=1, length=9, **SAMPLED)]
    out = h.run(spec, module, rows=rows, prefill_row=[1], prompt_tokens=chunk, prompt_start=[0],
                prompt_final=[True], next_prompt_token=[5], draft_tokens=torch.ones(desc.batch_capacity, desc.width - 1))
    return out, h.state


@pytest.mark.numerics
@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.id)
def test_C1_exported_saved_loaded_program_equals_eager(desc, tmp_path):
    spec = build_program(desc, CONFIG, LAYOUT)
    ep = torch.export.export(spec.module, spec.example_args, strict=False)
    ep.example_inputs = None
    torch.export.save(ep, tmp_path / "program.pt2")
    loaded = torch.export.load(tmp_path / "program.pt2").module()
    with recorded_decisions() as decisions:
        eager_out, eager_state = _state_after(desc, None, spec, 20)
    loaded_out, loaded_state = _state_after(desc, loaded, spec, 20)
    for name in spec.output_names:
        assert eager_out[name].dtype == dict((s.name, s.dtype) for s in spec.outputs)[name]
    # The loaded graph may run other kernels than eager: floats within the model's reordering
    # bound; tokens exact unless a decision of the eager run was a near-tie (then the commits
    # that follow from the tokens may differ too, and only the floats are compared).
    if assert_tokens_match(loaded_out["tokens"], eager_out["tokens"], decisions, TOLERANCE, desc.id):
        return
    assert_states_close({n: loaded_out[n] for n in spec.output_names}, {n: eager_out[n] for n in spec.output_names},
                        TOLERANCE, f"{desc.id} outputs")
    assert_states_close({n: loaded_state[n] for n in spec.mutated_inputs},
                        {n: eager_state[n] for n in spec.mutated_inputs}, TOLERANCE, f"{desc.id} state")
    assert eager_out["num_tokens"].sum() > 0, "the frame did real work"


def test_program_signature_lists_inputs_in_call_order():
    spec = build_program(MIXED, CONFIG, LAYOUT)
    assert spec.input_names[0] == "weights" and spec.weight_keys == CONFIG.weight_keys()
    assert spec.input_names[1:] == tuple(s.name for s in spec.inputs)
    assert spec.mutated_inputs == ("k_cache", "v_cache", "pending", "seq_lens", "token_counts", "prompt_seen")
    shapes = {s.name: s.shape for s in spec.inputs}
    assert shapes["draft_tokens"] == (4, 2) and shapes["prompt_tokens"] == (16,)
    assert spec.module.shape.packed == 16 + 3 * 3  # C10: prefill_capacity + (B - 1) * W


@pytest.mark.parametrize(
    "desc, message",
    [
        (GraphDescriptor("d", GraphKind.DECODE, 2, width=2), "decode has width 1"),
        (GraphDescriptor("p", GraphKind.PREFILL, 2, prefill_capacity=64), "batch_capacity 1"),
        (GraphDescriptor("m", GraphKind.MIXED, 2, width=4, prefill_capacity=2), "must be >= width"),
        (GraphDescriptor("v", GraphKind.VISION, 1), "no program builder for kind 'vision'"),
    ],
)
def test_bad_descriptors_are_rejected_with_a_reason(desc, message):
    with pytest.raises(ValueError, match=message):
        build_program(desc, CONFIG, LAYOUT)


@pytest.mark.numerics
def test_C14_mixed_without_a_prompt_row_equals_speculative_verification():
    """prefill_row = -1: a decode-only population runs in a mixed program like in a speculative one."""
    spec_desc = GraphDescriptor("spec-4x3", GraphKind.SPECULATIVE, 4, proposal_depth=2, width=3)
    results = []
    with recorded_decisions() as decisions:
        for desc, extra in ((MIXED, dict(prefill_row=[-1])), (spec_desc, {})):
            h = Harness()
            for slot in (0, 2):
                h.prefill(slot, _prompt(6 + slot, 30 + slot), SAMPLED)
            drafts = torch.tensor([[5, 6], [7, 8], [0, 0], [0, 0]])
            rows = [dict(slot=2, length=3, **SAMPLED), dict(slot=0, length=2, **SAMPLED)]
            out = h.run(build_program(desc, CONFIG, LAYOUT, WEIGHTS), rows=rows, draft_tokens=drafts, **extra)
            results.append((out, h.state))
    (mixed_out, mixed_state), (spec_out, spec_state) = results
    # Two program shapes, so two blockings of the same sums: floats within the model's bound,
    # tokens exact unless one of the decisions was a near-tie (then what follows from them may differ).
    if assert_tokens_match(mixed_out["tokens"], spec_out["tokens"], decisions, TOLERANCE, "mixed vs speculative"):
        return
    assert torch.equal(mixed_out["num_tokens"], spec_out["num_tokens"])
    assert_states_close(mixed_state, spec_state, TOLERANCE, "mixed vs speculative")


def test_C4_width_one_speculative_variant_decodes_like_decode():
    """Width-one speculative programs (D = 0) behave as ordinary decode for now."""
    width_one = GraphDescriptor("spec-2x1", GraphKind.SPECULATIVE, 2, width=1, speculation_enabled=True)
    decode = GraphDescriptor("decode-2", GraphKind.DECODE, 2)
    streams = []
    for desc in (width_one, decode):
        h = Harness()
        h.prefill(1, _prompt(9, 41), SAMPLED)
        spec = build_program(desc, CONFIG, LAYOUT, WEIGHTS)
        streams.append([int(h.run(spec, rows=[dict(slot=1, length=1, **SAMPLED)])["tokens"][0, 0]) for _ in range(4)])
    assert streams[0] == streams[1]


MIXED_EXAMPLES = 6 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 20


@st.composite
def mixed_cohorts(draw):
    """A mixed frame: rows in any order over distinct slots, some inactive, maybe one prompt row."""
    slots = draw(st.permutations(range(4)))
    lengths = [draw(st.integers(0, 3)) for _ in range(4)]
    prompt_row = draw(st.sampled_from([None, 0, 1, 2, 3]))
    prompt_len = draw(st.integers(1, 16))
    wrong = [draw(st.sampled_from([None, 0, 1])) for _ in range(4)]
    return slots, lengths, prompt_row, prompt_len, wrong


@pytest.mark.slow
@settings(max_examples=MIXED_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cohort=mixed_cohorts())
def test_C14_any_mixed_cohort_commits_what_plain_decoding_would(cohort):
    slots, lengths, prompt_row, prompt_len, wrong = cohort
    h, prompts = Harness(), {s: _prompt(3 + 2 * s, 50 + s) for s in range(4)}
    for s, p in prompts.items():
        h.prefill(s, p, SAMPLED)
    before = {k: v.clone() for k, v in h.state.items()}
    new_prompt = _prompt(prompt_len, 60)
    if prompt_row is not None:
        lengths[prompt_row] = prompt_len
    want = {s: reference_generate(prompts[s], 4, SAMPLED) for s, n in zip(slots, lengths) if n}
    drafts = torch.zeros(4, 2, dtype=torch.int64)
    for r, (s, n, bad) in enumerate(zip(slots, lengths, wrong)):
        if n and r != prompt_row:
            drafts[r] = torch.tensor(_drafts(want[s][1:], bad, 3))
    chunk = torch.zeros(16, dtype=torch.int64)
    chunk[:prompt_len] = torch.tensor(new_prompt)
    rows = [dict(slot=s, length=n, **SAMPLED) for s, n in zip(slots, lengths)]
    out = h.run(build_program(MIXED, CONFIG, LAYOUT, WEIGHTS), rows=rows, draft_tokens=drafts, prompt_tokens=chunk,
                prefill_row=[-1 if prompt_row is None else prompt_row], prompt_start=[0], prompt_final=[True])
    for r, (s, n, bad) in enumerate(zip(slots, lengths, wrong)):
        count = int(out["num_tokens"][r])
        if r == prompt_row:
            assert count == 1 and int(out["tokens"][r, 0]) == reference_generate(new_prompt, 1, SAMPLED)[0]
            assert int(h.state["seq_lens"][s]) == prompt_len
        elif n:
            assert count == (bad + 1 if bad is not None and bad < n - 1 else n)
            assert out["tokens"][r, :count].tolist() == want[s][1 : 1 + count]
            assert int(h.state["seq_lens"][s]) == len(prompts[s]) + count
        else:
            assert count == 0
            pages = h.page_table[s].long()
            for name in ("k_cache", "v_cache"):
                assert torch.equal(h.state[name][:, pages], before[name][:, pages])
            assert int(h.state["seq_lens"][s]) == int(before["seq_lens"][s])
            assert int(h.state["pending"][s]) == int(before["pending"][s])
