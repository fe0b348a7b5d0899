"""A small seeded target/draft pair and a frame driver for the speculative program tests.

The draft is the target's architecture with perturbed weights, so it agrees
with the target often but not always: rounds exercise both acceptance and
rejection. Slot ``s`` owns pages ``s*M .. s*M+M-1``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from ignition.models.programs import StateLayout, build_program
from ignition.models.proposals import DRAFT_PREFIX
from ignition.models.qwen3 import PagedBatch, Qwen3, Qwen3Config


def config(vocab: int, layers: int = 2, hidden: int = 32) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                       head_dim=8, intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=128, tie_word_embeddings=False)


def weights(cfg: Qwen3Config, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * (scale if len(s) > 1 else 0.1) + (len(s) == 1)
            for k, s in cfg.weight_shapes().items()}


def perturbed(w: dict[str, torch.Tensor], seed: int, noise: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: t + noise * torch.randn(t.shape, generator=gen) for k, t in w.items()}


LAYOUT = StateLayout(request_slots=4, page_size=4, num_pages=4 * 12, max_pages_per_slot=12)
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0, seed=0)


def learned(id_: str, kind: GraphKind, b: int, w: int, **more) -> GraphDescriptor:
    source = more.pop("proposal_source", "learned")
    value = more.pop("value_source", ValueSource.QUERY_LENGTH if w > 1 else None)
    return GraphDescriptor(id_, kind, b, proposal_depth=w - 1, width=w, proposal_source=source,
                           value_source=value, speculation_enabled=True, **more)


PREFILL = GraphDescriptor("prefill_p16", GraphKind.PREFILL, 1, prefill_capacity=16)
DECODE4 = GraphDescriptor("decode_b4", GraphKind.DECODE, 4)
SPEC_W1 = learned("spec_b4_w1", GraphKind.SPECULATIVE, 4, 1)
SPEC_B2W3 = learned("spec_b2_w3", GraphKind.SPECULATIVE, 2, 3)
SPEC_B1W4 = learned("spec_b1_w4", GraphKind.SPECULATIVE, 1, 4)
SPEC_B4W3 = learned("spec_b4_w3", GraphKind.SPECULATIVE, 4, 3)
RAGGED_QL = learned("spec_b4_w4_p8_ql", GraphKind.SPECULATIVE, 4, 4, aggregate=8, ragged=True)
RAGGED_PL = learned("spec_b4_w4_p8_pl", GraphKind.SPECULATIVE, 4, 4, aggregate=8, ragged=True,
                    value_source=ValueSource.PREFIX_LIMIT, confidence_width=3)
COPY_B2W3 = learned("spec_b2_w3_copy", GraphKind.SPECULATIVE, 2, 3, proposal_source="copy")
MIXED_W3 = learned("mixed_b2_w3_p16", GraphKind.MIXED, 2, 3, prefill_capacity=16)
MIXED_W1 = learned("mixed_b2_w1_p16", GraphKind.MIXED, 2, 1, prefill_capacity=16)


@dataclass
class Model:
    """A target/draft pair with built programs (cached per descriptor)."""

    target: Qwen3Config
    draft: Qwen3Config
    weights: dict[str, torch.Tensor]  # target keys plus draft keys prefixed "draft."

    @classmethod
    def seeded(cls, vocab: int, seed: int = 0, noise: float = 0.05) -> Model:
        target = config(vocab)
        w = weights(target, seed)
        return cls(target, target, {**w, **{DRAFT_PREFIX + k: t for k, t in perturbed(w, seed + 1, noise).items()}})

    def __hash__(self) -> int:
        return id(self)

    @functools.cache
    def spec(self, desc: GraphDescriptor):
        return build_program(desc, self.target, LAYOUT, self.weights, draft_config=self.draft)

    def reference_logits(self, tokens: list[int], draft: bool = False) -> torch.Tensor:
        """A plain forward over one sequence in a fresh cache: logits [n, vocab]."""
        cfg = self.draft if draft else self.target
        w = {k.removeprefix(DRAFT_PREFIX): t for k, t in self.weights.items() if k.startswith(DRAFT_PREFIX) == draft}
        cache = LAYOUT.new_state(cfg)
        model, one = Qwen3(cfg), torch.ones(1, dtype=torch.int32)
        batch = PagedBatch(page_table(), one * 0, one * len(tokens), one * 0)
        hidden = model(w, torch.tensor(tokens), torch.arange(len(tokens)), batch, cache["k_cache"], cache["v_cache"])
        return model.logits(w, hidden), cache


def page_table() -> torch.Tensor:
    return torch.arange(LAYOUT.num_pages, dtype=torch.int32).view(LAYOUT.request_slots, -1)


@dataclass
class Frames:
    """Persistent state of one model plus calls by descriptor and per-row settings."""

    model: Model
    state: dict = field(default=None)

    def __post_init__(self) -> None:
        self.state = self.state or LAYOUT.new_state(self.model.target, self.model.draft)

    def call(self, desc: GraphDescriptor, rows: list[dict], module=None, **extra) -> dict:
        """Run ``desc``'s program (or ``module``, e.g. its exported twin) on the state."""
        spec = self.model.spec(desc)
        named = {**self.state, "page_table": page_table(), **row_columns(desc.batch_capacity, rows), **extra}
        args = [spec.example_args[0]]
        for tensor_spec in spec.inputs:
            args.append(named[tensor_spec.name] if tensor_spec.name in named else _default(tensor_spec))
        return dict(zip(spec.output_names, (module or spec.module)(*args), strict=True))

    def prefill(self, slot: int, prompt: list[int], params: dict) -> int:
        tokens = torch.zeros(16, dtype=torch.int64)
        tokens[: len(prompt)] = torch.tensor(prompt)
        out = self.call(PREFILL, [dict(slot=slot, length=len(prompt), **params)], prompt_tokens=tokens,
                        prompt_start=torch.tensor([0], dtype=torch.int32), prompt_final=torch.tensor([True]))
        return int(out["tokens"][0, 0])


def row_columns(batch: int, rows: list[dict]) -> dict[str, torch.Tensor]:
    rows = list(rows) + [dict(slot=0, length=0)] * (batch - len(rows))
    column = lambda key, default, dtype: torch.tensor([r.get(key, default) for r in rows], dtype=dtype)
    return {
        "row_slots": column("slot", 0, torch.int32),
        "query_lens": column("length", 0, torch.int32),
        "temperature": column("temperature", 0.0, torch.float32),
        "top_k": column("top_k", 0, torch.int32),
        "top_p": column("top_p", 1.0, torch.float32),
        "seed": column("seed", 0, torch.int64),
    }


def _default(spec) -> torch.Tensor:
    if spec.name == "prefill_row":
        return torch.full(spec.shape, -1, dtype=spec.dtype)
    return torch.zeros(spec.shape, dtype=spec.dtype)


def committed(out: dict, row: int) -> list[int]:
    return out["tokens"][row, : int(out["num_tokens"][row])].tolist()
