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


def reference_scores(tokens: list[int], sampling=None) -> tuple[torch.Tensor, float]:
    """The eager target's scores for the token after ``tokens``, and the near-tie margin there.

    Greedy (``sampling`` None or temperature 0): the scores are the logits. Seeded
    sampling (anything with temperature, top_k, top_p and seed): the exponential
    race's noised scores at the produced token's position (tests/helios/numerics.py).
    The margin is how far two paths through this model may disagree on a score at
    this context, so two candidates closer than it are a near-tie.
    """
    from numerics import decision_scores, near_tie_margin, qwen3_tolerance

    logits = next_token_logits(tokens)
    scores = logits
    if sampling is not None and sampling.temperature > 0:
        one = torch.ones(1)
        scores = decision_scores(logits[None, None], one * sampling.temperature, (one * (sampling.top_k or 0)).int(),
                                 one * sampling.top_p, torch.tensor([sampling.seed]), torch.tensor([[len(tokens)]]))[0, 0]
    tolerance = qwen3_tolerance(target_config(), context=len(tokens) + 1)
    return scores, near_tie_margin(scores[torch.isfinite(scores)], tolerance)


def reference_choice(tokens: list[int], sampling=None) -> tuple[int, float, float]:
    """The reference's choice after ``tokens``, its lead over the runner-up, and the near-tie margin."""
    from numerics import decision_margins

    scores, margin = reference_scores(tokens, sampling)
    return int(scores.argmax()), float(decision_margins(scores)), margin


def assert_same_or_near_tie(prompt, want: list[int], got: list[int], sampling=None, what: str = "") -> bool:
    """Two paths' tokens for one prompt: equal, or first different where the reference was a near-tie.

    Different programs (other batch sizes, speculative widths, mixed frames) add
    the same terms in other orders, so a choice between two candidates whose
    scores are closer than the margin may go either way; anything else must
    agree. At the first difference, the token the other path chose must score
    within the margin of the reference's (or, where one output simply ended,
    the reference's lead must be within it). Returns whether the outputs diverged.
    """
    if list(want) == list(got):
        return False
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    scores, margin = reference_scores([*prompt, *want[:first]], sampling)
    if first < min(len(want), len(got)):
        gap = float(scores[want[first]] - scores[got[first]])
    else:
        gap = float(scores.max() - scores[torch.isfinite(scores)].topk(2).values[1])
    assert gap <= margin, (f"{what}: outputs diverge at token {first} ({list(want[first:first + 3])} vs "
                           f"{list(got[first:first + 3])}) where the reference prefers its choice by {gap:.3g}, "
                           f"more than a near-tie (<= {margin:.3g})")
    return True
