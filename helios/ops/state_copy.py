"""``flare::`` ops of the state programs (snapshot, restore, init; docs/checkpoints.md), Python kernels.

A snapshot copies a request slot's committed state into a checkpoint row, a
restore copies a row back into a slot, an init clears a slot's per-slot
state. The programs compute each row's page lists in the graph and call:

- ``copy_kv_positions``: the first ``tokens[b]`` positions of each active row,
  from the pages ``src_pages[b]`` of one paged cache to the pages
  ``dst_pages[b]`` of another (whole pages, then the partial last page's
  first positions; nothing past ``tokens[b]`` is written);
- ``copy_rows``: ``dst[dst_index[b]] = src[src_index[b]]`` (pending token,
  token history);
- ``copy_lengths``: the committed length, which must equal ``tokens[b]`` (a
  snapshot of fewer positions than the slot committed would pair the KV of a
  prefix with the history of the whole);
- ``zero_rows``: ``dst[index[b]] = 0``.

A row with ``tokens[b] <= 0`` (``active[b]`` false for ``zero_rows``) is
inactive and writes nothing. The work follows the copied positions, not the
programs' capacities. These kernels are plain torch, so one registration
serves CPU and CUDA tensors; they have no native twin yet (a state operation
runs once per checkpoint, not once per token).
"""

from __future__ import annotations

import torch

SCHEMAS = {
    "copy_kv_positions": "copy_kv_positions(Tensor(a0!) dst_k, Tensor(a1!) dst_v, Tensor src_k, Tensor src_v, "
                         "Tensor dst_pages, Tensor src_pages, Tensor tokens) -> ()",
    "copy_rows": "copy_rows(Tensor(a0!) dst, Tensor src, Tensor dst_index, Tensor src_index, Tensor tokens) -> ()",
    "copy_lengths": "copy_lengths(Tensor(a0!) dst, Tensor src, Tensor dst_index, Tensor src_index, "
                    "Tensor tokens) -> ()",
    "zero_rows": "zero_rows(Tensor(a0!) dst, Tensor index, Tensor active) -> ()",
}

_LIBRARY = torch.library.Library("flare", "FRAGMENT")  # kept alive for the process: dropping it removes the ops
for _schema in SCHEMAS.values():
    _LIBRARY.define(_schema)


def _active(tokens: torch.Tensor) -> list[tuple[int, int]]:
    return [(b, n) for b, n in enumerate(tokens.tolist()) if n > 0]


def copy_kv_positions(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                      dst_pages: torch.Tensor, src_pages: torch.Tensor, tokens: torch.Tensor) -> None:
    """Caches are ``[layers, pages, page_size, heads, head_dim]``; page lists ``[B, max_pages]``.

    Every active row is checked before anything is written; the whole pages of all rows then move in one
    indexed copy per cache (rows write disjoint pages: where two name one destination page, row by row, in
    row order, as the last writer wins), and each partial last page in one slice copy. The page lists are
    read as Python integers once: a state program copies a few rows, and each small tensor operation it
    replaces was a dispatch of its own.
    """
    active = _active(tokens)
    if not active:
        return
    page_size, max_pages = src_k.shape[2], src_pages.shape[1]
    source_rows, target_rows = src_pages.tolist(), dst_pages.tolist()
    copies = []  # per active row: (source pages, destination pages, positions on its last page)
    for b, count in active:
        full, rest = divmod(count, page_size)
        blocks = full + (1 if rest else 0)
        if blocks > max_pages:
            raise ValueError(f"row {b}: {count} positions exceed {max_pages} pages of {page_size}")
        source, target = source_rows[b][:blocks], target_rows[b][:blocks]
        if min(source) < 0 or min(target) < 0:
            raise ValueError(f"row {b}: a page of positions 0..{count - 1} is missing (-1) in the "
                             "source or destination page list; reserve every page before a state copy")
        copies.append((source, target, rest or page_size))
    targets = [t for _, target, _ in copies for t in target]
    if len(set(targets)) < len(targets):  # rows meet on a destination page: row by row, the last writer wins
        for source, target, last in copies:
            for i, (frm, to) in enumerate(zip(source, target)):
                n = last if i == len(target) - 1 else page_size
                for dst, src in ((dst_k, src_k), (dst_v, src_v)):
                    dst[:, to, :n] = src[:, frm, :n]
        return
    whole = [(frm, to) for source, target, last in copies
             for frm, to in zip(source if last == page_size else source[:-1], target)]
    if whole:
        frm, to = torch.tensor(whole, dtype=torch.long).unbind(1)
        for dst, src in ((dst_k, src_k), (dst_v, src_v)):
            dst[:, to] = src[:, frm]
    for source, target, last in copies:
        if last < page_size:
            for dst, src in ((dst_k, src_k), (dst_v, src_v)):
                dst[:, target[-1], :last] = src[:, source[-1], :last]


def _indices(dst: torch.Tensor, src: torch.Tensor, dst_index: torch.Tensor, src_index: torch.Tensor,
             tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The active rows' destination and source indices, checked (read as Python integers once)."""
    rows = [b for b, _ in _active(tokens)]
    to_all, frm_all = dst_index.tolist(), src_index.tolist()
    to, frm = [int(to_all[b]) for b in rows], [int(frm_all[b]) for b in rows]
    for name, index, size in (("destination", to, dst.shape[0]), ("source", frm, src.shape[0])):
        if index and not (0 <= min(index) and max(index) < size):
            raise ValueError(f"{name} rows {index} outside 0..{size - 1}")
    if len(set(to)) != len(to):
        raise ValueError(f"active rows share a destination ({to}): each appears in at most one row")
    return torch.tensor(to, dtype=torch.long), torch.tensor(frm, dtype=torch.long), rows


def copy_rows(dst: torch.Tensor, src: torch.Tensor, dst_index: torch.Tensor, src_index: torch.Tensor,
              tokens: torch.Tensor) -> None:
    to, frm, _ = _indices(dst, src, dst_index, src_index, tokens)
    if to.numel():
        dst.index_put_((to,), src[frm])


def copy_lengths(dst: torch.Tensor, src: torch.Tensor, dst_index: torch.Tensor, src_index: torch.Tensor,
                 tokens: torch.Tensor) -> None:
    to, frm, rows = _indices(dst, src, dst_index, src_index, tokens)
    if not to.numel():
        return
    committed, counts = src[frm].tolist(), tokens.tolist()
    expected = [counts[b] for b in rows]
    if committed != expected:
        raise ValueError(f"committed lengths {committed} differ from the copied positions "
                         f"{expected}: a state copy takes a slot's whole committed state")
    dst.index_put_((to,), torch.tensor(expected, dtype=dst.dtype))


def zero_rows(dst: torch.Tensor, index: torch.Tensor, active: torch.Tensor) -> None:
    rows = index[active].long()
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < dst.shape[0]):
        raise ValueError(f"rows {rows.tolist()} outside 0..{dst.shape[0] - 1}")
    if rows.numel():
        dst[rows] = 0


KERNELS = {"copy_kv_positions": copy_kv_positions, "copy_rows": copy_rows, "copy_lengths": copy_lengths,
           "zero_rows": zero_rows}

for _name, _kernel in KERNELS.items():
    for _key in ("CPU", "CUDA"):
        _LIBRARY.impl(_name, _kernel, _key)


@torch.library.register_fake("flare::copy_kv_positions", lib=_LIBRARY)
def _(dst_k, dst_v, src_k, src_v, dst_pages, src_pages, tokens) -> None:
    return None


@torch.library.register_fake("flare::copy_rows", lib=_LIBRARY)
def _(dst, src, dst_index, src_index, tokens) -> None:
    return None


@torch.library.register_fake("flare::copy_lengths", lib=_LIBRARY)
def _(dst, src, dst_index, src_index, tokens) -> None:
    return None


@torch.library.register_fake("flare::zero_rows", lib=_LIBRARY)
def _(dst, index, active) -> None:
    return None
