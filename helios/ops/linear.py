"""``flare::linear``, Python reference kernel: the model's matrix products.

The native kernel (csrc/flare_ops.cpp) streams each weight once for the rows
of a decode step or a prompt chunk of up to 256 tokens and calls ATen's GEMM
above 256 rows; this one is ATen throughout, with the same shape check.
"""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by ATen (the native kernel computes the same with its own small-batch loop)."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"flare::linear: x [..., {x.shape[-1] if x.dim() else '?'}] does not fit weight "
                         f"{list(weight.shape)}")
    return torch.nn.functional.linear(x, weight, bias)
