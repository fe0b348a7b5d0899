"""Packed-row geometry (spec C14): row ``b`` owns ``lens[b]`` consecutive packed
tokens starting at the prefix sum of the earlier rows' lengths, whatever its slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Packing:
    starts: Tensor  # int64 [B] packed offset of each row
    row_of: Tensor  # int64 [T] row owning each packed token (clamped into range for unused capacity)
    index_in_row: Tensor  # int64 [T]
    valid: Tensor  # bool [T] the token belongs to some row


def packing(lens: Tensor, capacity: int) -> Packing:
    """The layout of rows of lengths ``lens`` (int64 [B]) in ``capacity`` packed tokens."""
    ends = lens.cumsum(0)
    starts = ends - lens
    t = torch.arange(capacity, device=lens.device)
    row_of = torch.searchsorted(ends, t, right=True).clamp(max=lens.shape[0] - 1)
    return Packing(starts, row_of, t - starts[row_of], t < ends[-1])
