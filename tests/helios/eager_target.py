"""The bundled target model run eagerly, one dense sequence: the tests' reference for what programs compute.

``ignition.models`` is the model source the catalog was captured from; the
runtime never imports it, the tests may (a reference that does not share the
runtime's code path).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _target():
    from ignition.models.checkpoint import load_checkpoint
    from ignition.models.qwen3 import Qwen3
    from ignition.recipes import load_recipe

    recipe = load_recipe("flare-tiny").resolve()
    checkpoint = load_checkpoint(recipe.checkpoint_folder(), getattr(torch, recipe.dtype))  # as capture loads it
    return checkpoint, Qwen3(checkpoint.config)


def next_token_logits(tokens: list[int]) -> torch.Tensor:
    """The target's logits for the token after ``tokens`` (sampled vocabulary only)."""
    from ignition.models.qwen3 import PagedBatch

    checkpoint, model = _target()
    c = checkpoint.config
    page, pages = 16, len(tokens) // 16 + 1
    cache = [torch.zeros(c.num_layers, pages, page, c.num_kv_heads, c.head_dim) for _ in range(2)]
    n = torch.tensor([len(tokens)], dtype=torch.int32)
    batch = PagedBatch(torch.arange(pages, dtype=torch.int32)[None], n * 0, n, n * 0)
    with torch.no_grad():
        hidden = model(checkpoint.weights, torch.tensor(tokens), torch.arange(len(tokens)), batch, *cache)
        return model.logits(checkpoint.weights, hidden[-1])[: c.sampled_vocab_size]


def target_config():
    """The bundled target's model configuration (for tolerances derived from its arithmetic)."""
    return _target()[0].config
