"""How close two execution paths of the same arithmetic must agree, derived from the arithmetic.

Two paths that compute one function -- an exported program and its eager
module, a batch of four and a batch of one, a fresh process and this one, a
speculative round and plain decoding -- may add the same terms in another
order: another kernel (AVX-512, AVX2 or scalar, chosen per CPU), another
blocking for another matrix shape, a decomposed operator. Their floating-point
results then differ in the last bits, by an amount that depends on the CPU,
so a test that wants them bitwise equal passes only on the machine it was
written on. What the arithmetic does bound:

* One reduction of ``n`` terms in a format with unit roundoff ``u`` lies, in
  any order, within ``gamma_n * sum|terms|`` of the exact sum, with
  ``gamma_n = n*u / (1 - n*u)`` (the standard worst-case bound for recursive
  summation and dot products; blocked and pairwise orders do better). Two
  orders therefore differ by at most ``2 * gamma_n`` relative to the sum of
  magnitudes.
* An elementwise function (exp, tanh, rsqrt, sigmoid, ...) is within a couple
  of ulps in every vector or scalar implementation: ``2u`` per path, ``4u``
  between two.
* A chain of ``s`` dependent stages (a network of reductions and elementwise
  functions) adds the stages' relative errors to first order, so the relative
  tolerance of the chain is the sum over its stages.

The bounds are relative to ``sum|terms|`` of each reduction, which a test does
not see; the tests take the largest magnitude of the reference result as the
scale (``atol = tolerance * max|reference|``). For ``n`` incoherent terms the
sum of magnitudes is about ``sqrt(n)`` times larger than the result, while the
error of a real reduction is about ``sqrt(n)`` times smaller than the
worst-case ``gamma_n`` (rounding errors of random sign): the two factors
cancel, and what remains is still the worst-case ``n*u`` per stage, far
outside any reordering difference actually seen and far inside any defect (a
wrong position, mask, page or weight changes results at the scale of the
values themselves).

Tokens, counts, page tables and other integer state stay exact. A greedy (or
seeded) choice may flip only where two candidates' scores are within the two
paths' combined tolerance of each other: ``assert_choices_match`` allows
exactly that and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one correctly rounded operation."""
    return torch.finfo(dtype).eps / 2


def reorder_tolerance(dtype: torch.dtype, length: int) -> float:
    """Relative difference two summation orders of ``length`` terms can show: 2 * gamma_n."""
    n_u = max(length - 1, 1) * unit_roundoff(dtype)
    assert n_u < 0.5, f"a reduction of {length} terms in {dtype} has no useful bound"
    return 2 * n_u / (1 - n_u)


def chain_tolerance(dtype: torch.dtype, lengths: Iterable[int]) -> float:
    """Relative tolerance of a chain of dependent stages, one per reduction length in ``lengths``.

    Each stage contributes its reordering bound and the few ulps of the
    elementwise functions applied to its result (4u between two paths).
    """
    u = unit_roundoff(dtype)
    return sum(reorder_tolerance(dtype, n) + 4 * u for n in lengths)


def qwen3_stages(config, context: int) -> list[int]:
    """Reduction lengths along the longest dependent chain of a Qwen3 forward pass.

    Per layer: the input RMSNorm (hidden), the q/k/v projections (hidden), the
    q/k norms (head_dim), the attention scores (head_dim), the softmax
    normaliser and the weighted sum of values (context positions), the output
    projection (heads * head_dim), the post-attention RMSNorm (hidden), the
    gate/up projections (hidden) and the down projection (intermediate); then
    the final norm and the output head (hidden).
    """
    per_layer = [config.hidden_size, config.hidden_size, config.head_dim, config.head_dim, context, context,
                 config.num_heads * config.head_dim, config.hidden_size, config.hidden_size,
                 config.intermediate_size]
    return per_layer * config.num_layers + [config.hidden_size, config.hidden_size]


def qwen3_tolerance(config, context: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance of a Qwen3 model's logits (and, a fortiori, of any earlier activation)."""
    return chain_tolerance(dtype, qwen3_stages(config, context))


def assert_close_paths(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str = "") -> None:
    """Floating tensors within ``tolerance`` relative to the reference's scale; other dtypes exact."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)} " \
                                                                f"vs {want.dtype}{tuple(want.shape)}"
    if not want.is_floating_point():
        assert torch.equal(got, want), f"{what}: differs (integer values compare exactly)"
        return
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * max(scale, 1e-30),
                               msg=lambda m: f"{what}: {m} (tolerance {tolerance:.3g} of scale {scale:.3g})")


def assert_states_close(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], tolerance: float,
                        what: str = "") -> None:
    """Every tensor of two state dictionaries: floats within ``tolerance``, integers exact."""
    assert set(got) == set(want), f"{what}: state names differ"
    for name in want:
        assert_close_paths(got[name], want[name], tolerance, f"{what} {name}".strip())


def near_tie_margin(scores: torch.Tensor, tolerance: float) -> float:
    """How close two candidates' scores may be for two paths to pick differently: both paths' errors."""
    return 2 * tolerance * max(float(scores.abs().max()), 1e-30)


def assert_choices_match(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, tolerance: float,
                         what: str = "") -> int:
    """Argmax choices equal, except where the reference's scores make the two a near-tie.

    ``scores[..., v]`` are the reference path's scores for the choices in
    ``want`` (logits for greedy; noised logits for seeded sampling). A choice
    ``got != want`` is accepted only if its score is within the near-tie
    margin of the best. Returns how many choices were near-ties that flipped.
    """
    assert got.shape == want.shape == scores.shape[:-1], f"{what}: shapes differ"
    flipped = got != want
    if not flipped.any():
        return 0
    margin = near_tie_margin(scores, tolerance)
    best = scores.max(dim=-1).values
    theirs = scores.gather(-1, got.long().unsqueeze(-1)).squeeze(-1)
    gaps = (best - theirs)[flipped]
    assert bool((gaps <= margin).all()), f"{what}: choices differ beyond a near-tie (gaps {gaps.tolist()}, " \
                                         f"margin {margin:.3g})"
    return int(flipped.sum())


def decision_scores(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    seed: torch.Tensor, positions: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The scores whose argmax ``ignition.models.sampling.sample`` takes, on a logit scale.

    Greedy rows: the logits. Sampled rows: log(filtered probabilities) - log(q)
    for the exponential race's noise q, which has the same argmax as probs / q.
    Scores of sampled rows are divided by the temperature, so their error is too.
    """
    from ignition.models.sampling import exponential_noise, filter_top_k_top_p

    scaled = logits / temperature.clamp(min=1e-5)[:, None, None]
    raced = filter_top_k_top_p(scaled, top_k, top_p, min_p).log_softmax(-1) - exponential_noise(
        seed, positions, logits.shape[-1]).log()
    return torch.where((temperature > 0)[:, None, None], raced, logits)


def decision_margins(scores: torch.Tensor) -> torch.Tensor:
    """Best minus second-best finite score of every decision (``inf`` where only one candidate remains)."""
    finite = scores.masked_fill(~torch.isfinite(scores), float("-inf"))
    top = finite.topk(2, dim=-1).values
    return torch.where(torch.isfinite(top[..., 1]), top[..., 0] - top[..., 1], torch.full_like(top[..., 0], float("inf")))


class DecisionRecorder:
    """Every decision the eager frame code samples while active: its margin, and the scale of its scores."""

    def __init__(self) -> None:
        self.margins: list[float] = []
        self.scales: list[float] = []

    def smallest_relative_margin(self) -> float:
        """min over decisions of margin / scale: how near the closest call of the run was to a tie."""
        return min((m / max(s, 1e-30) for m, s in zip(self.margins, self.scales)), default=float("inf"))

    def explains_a_flip(self, tolerance: float) -> bool:
        """Whether some decision was close enough to a tie for another path, within ``tolerance``, to flip it."""
        return self.smallest_relative_margin() <= 2 * tolerance


@contextmanager
def recorded_decisions() -> Iterator[DecisionRecorder]:
    """Record the decisions of eager frame programs run inside the block: the target's samples
    (ignition.models.frame) and the draft's proposals (ignition.models.proposals)."""
    import ignition.models.frame as frame
    import ignition.models.proposals as proposals
    from ignition.models.sampling import sample as original

    recorder = DecisionRecorder()

    def recording(logits, temperature, top_k, top_p, seed, positions, min_p=None):
        scores = decision_scores(logits, temperature, top_k, top_p, seed, positions, min_p)
        recorder.margins.extend(decision_margins(scores).flatten().tolist())
        scale = scores.masked_fill(~torch.isfinite(scores), 0).abs().amax(dim=-1)
        recorder.scales.extend(scale.flatten().tolist())
        return original(logits, temperature, top_k, top_p, seed, positions, min_p)

    frame.sample = proposals.sample = recording
    try:
        yield recorder
    finally:
        frame.sample = proposals.sample = original


def assert_tokens_match(got: torch.Tensor, want: torch.Tensor, decisions: DecisionRecorder, tolerance: float,
                        what: str = "") -> bool:
    """Token tensors equal; a difference is accepted only if the reference run made a near-tie decision.

    Returns whether the tokens differed (so a caller can skip comparisons that follow from them).
    """
    if torch.equal(got, want):
        return False
    assert decisions.explains_a_flip(tolerance), (
        f"{what}: tokens differ ({got.tolist()} vs {want.tolist()}) but the reference's closest decision had a "
        f"relative margin of {decisions.smallest_relative_margin():.3g}, above the near-tie bound {2 * tolerance:.3g}")
    return True
