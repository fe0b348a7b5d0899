"""Qwen3 dense decoder as one packed, variable-length forward over a paged KV cache.

Prefill chunks, decode steps, speculative verification and mixed frames are
all the same computation: a packed token axis ``[T]`` whose rows (requests)
each continue their own sequence in the paged cache. Only the static sizes
differ, so every prepared program is a fixed shape of this one function.

Weights are an argument, not parameters: one safetensors file serves every
program, and exported programs stay small. Keys follow the Hugging Face
checkpoint names, so a checkpoint's tensors are used as stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import helios.ops  # noqa: F401  (registers flare::write_kv and flare::paged_attention)

Weights = dict[str, Tensor]


class ModelConfigError(ValueError):
    """A config.json that does not describe a supported Qwen3 dense model."""


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # Ids >= this are never sampled or scored (a padded embedding table has
    # rows the tokenizer does not define); defaults to the whole vocabulary.
    output_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.output_vocab_size is not None and not 0 < self.output_vocab_size <= self.vocab_size:
            raise ModelConfigError(f"output_vocab_size must be in 1..{self.vocab_size}, got {self.output_vocab_size}")

    @property
    def sampled_vocab_size(self) -> int:
        return self.output_vocab_size or self.vocab_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any], output_vocab_size: int | None = None) -> Qwen3Config:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        if hf.get("model_type") != "qwen3":
            raise ModelConfigError(f"model_type must be 'qwen3', got {hf.get('model_type')!r}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelConfigError(f"only default RoPE is supported, got {rope}")
        try:
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"],
                num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"],
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                max_position_embeddings=hf["max_position_embeddings"],
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", False)),
                output_vocab_size=output_vocab_size,
            )
        except KeyError as missing:
            raise ModelConfigError(f"config.json lacks the field {missing}") from None

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the forward reads, in the program contract's key order."""
        shapes = {"model.embed_tokens.weight": (self.vocab_size, self.hidden_size)}
        for i in range(self.num_layers):
            shapes.update(_layer_shapes(self, f"model.layers.{i}."))
        shapes["model.norm.weight"] = (self.hidden_size,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return shapes

    def weight_keys(self) -> tuple[str, ...]:
        return tuple(self.weight_shapes())


def _layer_shapes(c: Qwen3Config, p: str) -> dict[str, tuple[int, ...]]:
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        p + "input_layernorm.weight": (c.hidden_size,),
        p + "self_attn.q_proj.weight": (q_out, c.hidden_size),
        p + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
        p + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
        p + "self_attn.o_proj.weight": (c.hidden_size, q_out),
        p + "self_attn.q_norm.weight": (c.head_dim,),
        p + "self_attn.k_norm.weight": (c.head_dim,),
        p + "post_attention_layernorm.weight": (c.hidden_size,),
        p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    if c.attention_bias:
        for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[p + f"self_attn.{name}_proj.bias"] = (size,)
    return shapes


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where each packed row's tokens live: the attention ops' metadata."""

    page_table: Tensor  # int32 [slots, max_pages_per_slot]
    row_slots: Tensor  # int32 [B]
    query_lens: Tensor  # int32 [B]; 0 = inactive row
    start_pos: Tensor  # int32 [B] position of each row's first packed token


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` through ``flare::linear``: its native kernel streams each weight once for the
    few rows of a decode step (ATen's GEMM serves prefill). Training keeps ``F.linear``, which has a gradient."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    return torch.ops.flare.linear(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin ``[T, head_dim]`` for absolute positions (half-rotation layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class Qwen3(nn.Module):
    """The decoder. Holds only the config; weights come with every call."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config

    def forward(self, w: Weights, tokens: Tensor, positions: Tensor, batch: PagedBatch,
                k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Hidden states ``[T, hidden]`` of the packed tokens; writes their K/V to the cache."""
        c = self.config
        x = F.embedding(tokens, w["model.embed_tokens.weight"])  # [T, hidden]
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            x = x + self.attention(w, p, i, h, cos, sin, batch, k_cache, v_cache)
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + self.feed_forward(w, p, h)
        return rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)

    def attention(self, w: Weights, p: str, layer: int, x: Tensor, cos: Tensor, sin: Tensor,
                  batch: PagedBatch, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        c, tokens = self.config, x.shape[0]
        q = self._project(w, p, "q", x).view(tokens, c.num_heads, c.head_dim)
        k = self._project(w, p, "k", x).view(tokens, c.num_kv_heads, c.head_dim)
        v = self._project(w, p, "v", x).view(tokens, c.num_kv_heads, c.head_dim)
        q = apply_rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps), cos, sin)
        meta = (batch.page_table, batch.row_slots, batch.query_lens, batch.start_pos)
        torch.ops.flare.write_kv(k_cache, v_cache, layer, k, v, *meta)
        out = torch.ops.flare.paged_attention(q, k_cache, v_cache, layer, *meta, 1 / math.sqrt(c.head_dim))
        return linear(out.reshape(tokens, c.num_heads * c.head_dim), w[p + "self_attn.o_proj.weight"])

    def _project(self, w: Weights, p: str, name: str, x: Tensor) -> Tensor:
        return linear(x, w[p + f"self_attn.{name}_proj.weight"], w.get(p + f"self_attn.{name}_proj.bias"))

    def feed_forward(self, w: Weights, p: str, x: Tensor) -> Tensor:
        gate = F.silu(linear(x, w[p + "mlp.gate_proj.weight"]))
        return linear(gate * linear(x, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])

    def logits(self, w: Weights, hidden: Tensor) -> Tensor:
        """Vocabulary logits ``[..., vocab]`` (float32) of selected hidden states."""
        head = w["model.embed_tokens.weight"] if self.config.tie_word_embeddings else w["lm_head.weight"]
        return linear(hidden, head).float()
