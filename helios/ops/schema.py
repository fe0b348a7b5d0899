"""The ``flare::`` op schemas and their fake (shape-only) kernels, defined once.

The CPU implementation is chosen separately (``helios.ops.kernels``): the
native kernels of ``helios/ops/csrc/flare_ops.cpp`` or the Python reference
kernels of ``attention``, ``kv_cache`` and ``slot_state``. A program calls the
op by name, so an exported or compiled program runs on whichever is installed.
The schemas are what ``torch.library.custom_op`` produced for the Python
kernels before (catalogs captured then still resolve).
"""

from __future__ import annotations

import torch

SCHEMAS = {
    "write_kv": "write_kv(Tensor(a0!) k_cache, Tensor(a1!) v_cache, SymInt layer, Tensor k, Tensor v, "
                "Tensor page_table, Tensor row_slots, Tensor query_lens, Tensor start_pos) -> ()",
    "paged_attention": "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, SymInt layer, Tensor page_table, "
                       "Tensor row_slots, Tensor query_lens, Tensor start_pos, float scale) -> Tensor",
    "write_slot_state": "write_slot_state(Tensor(a0!) pending, Tensor(a1!) seq_lens, Tensor row_slots, "
                        "Tensor query_lens, Tensor new_pending, Tensor new_seq_lens) -> ()",
    "write_token_history": "write_token_history(Tensor(a0!) token_counts, Tensor(a1!) prompt_seen, Tensor row_slots, "
                           "Tensor query_lens, Tensor new_counts, Tensor new_seen) -> ()",
    # x [..., in] @ weight[out, in]^T (+ bias): the model's matrix products, so small-M decode steps can use a
    # kernel that streams each weight once (native) while prefill keeps ATen's GEMM.
    "linear": "linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    # a weight laid out for flare::linear's packed kernel (native, AVX-512 builds only; helios.ops.kernels
    # packs_linear_weights says whether this process can), and whether a weight is so laid out. Called at
    # catalog load, never from a program.
    "pack_linear_weight": "pack_linear_weight(Tensor weight) -> Tensor",
    "pack_linear_weights": "pack_linear_weights(Tensor[] weights) -> Tensor[]",  # one allocation for all
    # the same placement (one huge-page allocation) for weights kept as they are
    "gather_weights": "gather_weights(Tensor[] weights) -> Tensor[]",
    "linear_weight_packed": "linear_weight_packed(Tensor weight) -> bool",
    # tokens [B, W] from processed logits [B, W, V]: greedy rows argmax, sampled rows the exponential race
    # (helios.ops.sampling), so the filter and the noise follow the rows that sample.
    "sample": "sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
              "Tensor positions, Tensor? min_p=None) -> Tensor",
}

_LIBRARY = torch.library.Library("flare", "DEF")  # kept alive for the process: dropping it removes the ops
for _schema in SCHEMAS.values():
    _LIBRARY.define(_schema)


@torch.library.register_fake("flare::write_kv", lib=_LIBRARY)
def _(k_cache, v_cache, layer, k, v, page_table, row_slots, query_lens, start_pos) -> None:
    return None


@torch.library.register_fake("flare::paged_attention", lib=_LIBRARY)
def _(q, k_cache, v_cache, layer, page_table, row_slots, query_lens, start_pos, scale):
    return torch.empty_like(q)


@torch.library.register_fake("flare::write_slot_state", lib=_LIBRARY)
def _(pending, seq_lens, row_slots, query_lens, new_pending, new_seq_lens) -> None:
    return None


@torch.library.register_fake("flare::write_token_history", lib=_LIBRARY)
def _(token_counts, prompt_seen, row_slots, query_lens, new_counts, new_seen) -> None:
    return None


@torch.library.register_fake("flare::linear", lib=_LIBRARY)
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("flare::sample", lib=_LIBRARY)
def _(logits, temperature, top_k, top_p, seed, positions, min_p=None):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)
