"""Snapshot, restore and init programs (docs/checkpoints.md) on a small random model, eagerly.

The heart: a prompt prefilled in one slot, snapshotted, restored into another
(dirty) slot and continued there commits what one uninterrupted prefill
commits, within the reordering tolerance of chunked against one-shot prefill
(tests/helios/numerics.py); the restored slot's pending token, length, KV and
token history equal the source's exactly; rows that are inactive mutate
nothing, and nothing past the copied positions is written.
"""

from __future__ import annotations

import pytest
import torch

from flare_contract.graphs import GraphDescriptor, GraphKind
from ignition.models.programs import StateLayout, build_program
from ignition.models.qwen3 import Qwen3Config
from numerics import assert_close_paths, assert_tokens_match, qwen3_tolerance, recorded_decisions
from speculation_harness import row_columns

CONFIG = Qwen3Config(
    vocab_size=72, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
    tie_word_embeddings=False, output_vocab_size=66,
)
DRAFT = Qwen3Config(
    vocab_size=72, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
    intermediate_size=24, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
    tie_word_embeddings=True,
)
PAGE = 4
LAYOUT = StateLayout(request_slots=4, page_size=PAGE, num_pages=48, max_pages_per_slot=10, checkpoint_rows=3)
CONTEXT = LAYOUT.max_pages_per_slot * PAGE
# Chunked and one-shot prefill add the same terms in other orders: the chain bound of this model's forward.
TOLERANCE = qwen3_tolerance(CONFIG, CONTEXT)
PREFILL = GraphDescriptor("prefill-16", GraphKind.PREFILL, 1, prefill_capacity=16)
DECODE = GraphDescriptor("decode-2", GraphKind.DECODE, 2)
SNAPSHOT = GraphDescriptor("snapshot_b2", GraphKind.SNAPSHOT, 2)
RESTORE = GraphDescriptor("restore_b2", GraphKind.RESTORE, 2)
INIT = GraphDescriptor("init_b2", GraphKind.INIT, 2)
GREEDY = dict(temperature=0.0, seed=0)
SAMPLED = dict(temperature=0.9, top_k=30, top_p=0.95, seed=1234567890123)
# Penalties read the token history, so a history the restore failed to copy changes the tokens.
PENALIZED = dict(temperature=0.0, seed=0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
CONTROLS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * (0.3 if len(s) > 1 else 1.0) + (len(s) == 1)
            for k, s in CONFIG.weight_shapes().items()}


WEIGHTS = _weights()
SPECS = {d.id: build_program(d, CONFIG, LAYOUT, WEIGHTS) for d in (PREFILL, DECODE, SNAPSHOT, RESTORE, INIT)}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG.sampled_vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Harness:
    """Slot state, the checkpoint store and a page table (slots own scattered pages)."""

    def __init__(self, seed: int = 5, draft: Qwen3Config | None = None) -> None:
        self.state = {**LAYOUT.new_state(CONFIG, draft), **LAYOUT.checkpoint_state(CONFIG, draft)}
        self.page_table = torch.randperm(LAYOUT.num_pages, generator=torch.Generator().manual_seed(seed))[:40]
        self.page_table = self.page_table.view(4, 10).int()

    def dirty(self, seed: int) -> None:
        """Random values everywhere: a copy that leaves something out shows."""
        gen = torch.Generator().manual_seed(seed)
        for t in self.state.values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen))
            elif t.dtype == torch.bool:
                t.copy_(torch.rand(t.shape, generator=gen) < 0.3)
            else:
                t.copy_(torch.randint(0, 5, t.shape, generator=gen))

    def run(self, spec, **frame) -> dict:
        named = {"weights": WEIGHTS, "page_table": self.page_table, **self.state, **frame}
        shapes = {s.name: s for s in spec.inputs}
        args = [named[name] if name in named else torch.zeros(shapes[name].shape, dtype=shapes[name].dtype)
                for name in spec.input_names]
        return dict(zip(spec.output_names, spec.module(*args), strict=True))

    def frame(self, spec, rows: list[dict], **extra) -> dict:
        columns = row_columns(spec.descriptor.batch_capacity, rows)
        padded = list(rows) + [{}] * (spec.descriptor.batch_capacity - len(rows))
        for name in CONTROLS:
            columns[name] = torch.tensor([r.get(name, 1.0 if name == "repetition_penalty" else 0.0) for r in padded])
        return self.run(spec, **columns, **extra)

    def prefill(self, slot: int, tokens: list[int], start: int, final: bool, params: dict) -> dict:
        chunk = torch.zeros(16, dtype=torch.int64)
        chunk[: len(tokens)] = torch.tensor(tokens)
        return self.frame(SPECS[PREFILL.id], [dict(slot=slot, length=len(tokens), **params)], prompt_tokens=chunk,
                          prompt_start=torch.tensor([start], dtype=torch.int32),
                          prompt_final=torch.tensor([final]))

    def decode(self, slot: int, params: dict) -> dict:
        return self.frame(SPECS[DECODE.id], [dict(slot=slot, length=1, **params)])

    def copy(self, spec_id: str, copies: list[tuple[int, int, int]]) -> dict:
        """(slot, checkpoint row, tokens) per row; later rows are padding (inactive)."""
        b = 2
        copies = copies + [(0, -1, 0)] * (b - len(copies))
        column = lambda i: torch.tensor([c[i] for c in copies], dtype=torch.int32)
        return self.run(SPECS[spec_id], row_slots=column(0), checkpoint_rows=column(1), checkpoint_tokens=column(2))

    def slot_kv(self, name: str, slot: int, count: int) -> torch.Tensor:
        positions = torch.arange(count)
        pages = self.page_table[slot].long()[positions // PAGE]
        return self.state[name][:, pages, positions % PAGE]

    def row_kv(self, name: str, row: int, count: int) -> torch.Tensor:
        positions = torch.arange(count)
        return self.state[name][:, row * LAYOUT.max_pages_per_slot + positions // PAGE, positions % PAGE]

    def history(self, slot: int, prefix: str = "") -> dict[str, torch.Tensor]:
        return {name: self.state[prefix + name][slot].clone()
                for name in ("pending", "seq_lens", "token_counts", "prompt_seen")}


def _continue(h: Harness, slot: int, rest: list[int], start: int, steps: int, params: dict):
    outs = [h.prefill(slot, rest, start, True, params)]
    outs += [h.decode(slot, params) for _ in range(steps)]
    tokens = torch.tensor([int(o["tokens"][0, 0]) for o in outs])
    logprobs = torch.stack([o["token_logprobs"][0, 0] for o in outs])
    top = torch.stack([o["top_logprobs"][0, 0] for o in outs])
    return tokens, logprobs, top


@pytest.mark.numerics
@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALIZED], ids=["greedy", "sampled", "penalized"])
def test_snapshot_restore_then_continue_equals_one_uninterrupted_prefill(params):
    """n = 11 (not a multiple of the page size 4), m = 5, k = 4: slot 0 prefills n, snapshots into row 2,
    a dirty slot 1 restores row 2 and prefills the m others, then both decode k tokens."""
    prompt, n, k = _prompt(16, 7), 11, 4
    reference = Harness()
    with recorded_decisions() as decisions:
        want = _continue(reference, 3, prompt, 0, k, params)
    h = Harness()
    h.dirty(11)  # the destination slot and the checkpoint row hold another request's leftovers
    h.prefill(0, prompt[:n], 0, False, params)
    assert h.copy(SNAPSHOT.id, [(0, 2, n)])["copied_tokens"].tolist() == [n, 0]
    h.prefill(0, _prompt(5, 99), 0, False, params)  # the source slot moves on; the checkpoint row must not
    assert h.copy(RESTORE.id, [(1, 2, n)])["copied_tokens"].tolist() == [n, 0]
    got = _continue(h, 1, prompt[n:], n, k, params)
    flipped = assert_tokens_match(got[0], want[0], decisions, TOLERANCE, "tokens")
    if not flipped:
        assert_close_paths(got[1], want[1], TOLERANCE, "token logprobs")
        assert_close_paths(got[2], want[2], TOLERANCE, "top logprobs")
        for name, value in h.history(1).items():  # integers: exact
            assert torch.equal(value, reference.history(3)[name]), name


def test_restored_slot_state_equals_the_source_exactly():
    """Pending token, committed length, token history and the KV of every copied position, partial page
    included, are the source slot's bit for bit, in a slot whose pages are elsewhere."""
    h = Harness()
    h.dirty(3)
    prompt = _prompt(11, 8)
    h.prefill(0, prompt[:7], 0, False, PENALIZED)
    h.prefill(0, prompt[7:], 7, True, PENALIZED)
    h.decode(0, PENALIZED)  # a terminal-style snapshot: the pending token is not in the cache yet
    n = int(h.state["seq_lens"][0])
    source = h.history(0)
    kv = {name: h.slot_kv(name, 0, n) for name in ("k_cache", "v_cache")}
    h.copy(SNAPSHOT.id, [(0, 1, n)])
    h.copy(RESTORE.id, [(3, 1, n)])
    for name, value in h.history(3).items():
        assert torch.equal(value, source[name]), name
    for name, value in kv.items():
        assert torch.equal(h.slot_kv(name, 3, n), value), name
    # and decoding on from the restored slot commits what the source commits
    assert h.decode(3, GREEDY)["tokens"][0].tolist() == h.decode(0, GREEDY)["tokens"][0].tolist()


def test_inactive_rows_and_positions_past_the_copy_mutate_nothing():
    """Row -1, tokens 0 and padding rows write nothing; an active row writes exactly its positions."""
    h = Harness(draft=DRAFT)
    h.dirty(4)
    h.state["seq_lens"][:] = torch.tensor([11, 6, 9, 3], dtype=torch.int32)
    h.state["checkpoint_seq_lens"][:] = torch.tensor([5, 11, 2], dtype=torch.int32)
    before = {name: t.clone() for name, t in h.state.items()}
    specs = {d.id: build_program(d, CONFIG, LAYOUT, draft_config=DRAFT) for d in (SNAPSHOT, RESTORE, INIT)}
    for spec_id in (SNAPSHOT.id, RESTORE.id):
        out = h.run(specs[spec_id], row_slots=torch.tensor([1, 2], dtype=torch.int32),
                    checkpoint_rows=torch.tensor([-1, 0], dtype=torch.int32),
                    checkpoint_tokens=torch.tensor([6, 0], dtype=torch.int32))
        assert out["copied_tokens"].tolist() == [0, 0]
    h.run(specs[INIT.id], row_slots=torch.tensor([1, 2], dtype=torch.int32), active=torch.tensor([False, False]))
    for name, value in h.state.items():
        assert torch.equal(value, before[name]), f"an inactive row wrote {name}"
    h.run(specs[SNAPSHOT.id], row_slots=torch.tensor([0, 3], dtype=torch.int32),
          checkpoint_rows=torch.tensor([1, -1], dtype=torch.int32), checkpoint_tokens=torch.tensor([11, 3], dtype=torch.int32))
    for name in ("checkpoint_k", "checkpoint_v", "checkpoint_draft_k", "checkpoint_draft_v"):
        written = torch.zeros(h.state[name].shape[1:3], dtype=torch.bool)
        written.view(3, -1)[1, :11] = True  # row 1's first 11 positions, the partial third page's 3 included
        assert torch.equal(h.state[name][:, ~written], before[name][:, ~written]), f"{name} past the copy"
        assert torch.equal(h.row_kv(name, 1, 11), h.slot_kv(name.replace("checkpoint_", "") + "_cache", 0, 11))
    for name in ("pending", "seq_lens", "token_counts", "prompt_seen"):
        changed = [r for r in range(3) if not torch.equal(h.state[f"checkpoint_{name}"][r], before[f"checkpoint_{name}"][r])]
        assert changed in ([1], []) and torch.equal(h.state[f"checkpoint_{name}"][1], h.state[name][0]), name
    slot_names = [n for n in h.state if not n.startswith("checkpoint_")]
    assert all(torch.equal(h.state[n], before[n]) for n in slot_names), "a snapshot wrote slot state"


def test_a_copy_of_fewer_positions_than_the_slot_committed_is_refused_before_writing():
    """The history tensors cover the whole committed prefix, so a shorter copy would be inconsistent."""
    h = Harness()
    h.dirty(6)
    h.state["seq_lens"][0] = 11
    before = {name: t.clone() for name, t in h.state.items()}
    with pytest.raises(ValueError, match="committed lengths \\[11\\] differ from the copied positions \\[10\\]"):
        h.copy(SNAPSHOT.id, [(0, 0, 10)])
    assert all(torch.equal(t, before[name]) for name, t in h.state.items())


def test_init_clears_the_slot_state_of_active_rows_only():
    h = Harness()
    h.dirty(9)
    before = {name: t.clone() for name, t in h.state.items()}
    out = h.run(SPECS[INIT.id], row_slots=torch.tensor([2, 0], dtype=torch.int32), active=torch.tensor([True, False]))
    assert out["reset"].tolist() == [True, False]
    for name in ("pending", "seq_lens", "token_counts", "prompt_seen"):
        assert not h.state[name][2].any(), name
        keep = [0, 1, 3]
        assert torch.equal(h.state[name][keep], before[name][keep]), name
    assert torch.equal(h.state["k_cache"], before["k_cache"])  # positions past seq_lens are never read


def test_state_programs_export_without_weights_and_record_what_they_write(tmp_path):
    from ignition.capture.export import export_program

    for desc, written in ((SNAPSHOT, "checkpoint_"), (RESTORE, "")):
        exported = export_program(SPECS[desc.id], tmp_path / f"{desc.id}.pt2", {"target": frozenset(WEIGHTS)})
        mutated = {a.name for a in exported.inputs if a.mutated}
        state = set(SPECS[desc.id].input_names) - {"page_table", "row_slots", "checkpoint_rows", "checkpoint_tokens"}
        assert mutated == {n for n in state if n.startswith("checkpoint_") == (written == "checkpoint_")}
        assert not any(a.weights for a in exported.inputs)


def test_snapshot_and_restore_need_a_checkpoint_store():
    bare = StateLayout(request_slots=4, page_size=PAGE, num_pages=48, max_pages_per_slot=10)
    with pytest.raises(ValueError, match="needs checkpoint rows"):
        build_program(SNAPSHOT, CONFIG, bare)
    assert build_program(INIT, CONFIG, bare).output_names == ("reset",)
