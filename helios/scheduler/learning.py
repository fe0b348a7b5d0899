"""Acceptance probes: which wider round funded learning may try for a lane (spec checklist D8, S9).

Ordinary selection scores speculative widths with the mean prefix-survival
estimates, so a request whose acceptance improved after its estimates went
low may never be offered a deeper prefix again and the means would never
learn. Funded acceptance learning fixes that. Once the learning ledger
(``refresh.py``) holds full credit, a lane may run one probe: a measured
program that

- offers at least one draft depth beyond what the ordinary choice offers the
  lane (after the proposal depth D, the width W and the output bound);
- beats the ordinary choice's value rate when the added depths are scored
  with the optimistic estimate min(1, mean + sqrt(ln 20 / (2 * weight))) (S9);
  depths the ordinary choice already offers keep their means, and the
  survival envelope stays nonincreasing, so optimism about a deep prefix
  never exceeds the belief about a shallower one;
- leaves future output to use the lesson: even if every offered draft is
  accepted, the request still has output left afterwards.

Candidates rank by optimistic gain (value-rate improvement over the ordinary
choice) per millisecond of the probe's own execution, because the ledger pays
in physical time. Ties prefer the least-informed added prefix (lowest aged
weight among the added depths), then the shorter execution, then the smaller
physical geometry (P, then B). Fixed-width execution never probes.

Everything here is a pure function of small frozen dataclasses; the core
supplies the lane's estimates, its ordinary choice and the measured
alternatives, and decides when a probe may run (credit, refresh precedence,
empty queue).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from flare_contract.graphs import GraphDescriptor
from helios.scheduler.refresh import ExplorationAccounts, StaleAlternative, refresh_choice
from helios.scheduler.speculation import PrefixSurvival, optimistic_survival
from helios.scheduler.types import SelectionReason

NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class WidthProgram:
    """A measured program a lane could run, seen from that lane.

    width          W: target rows the lane may use, the pending token included
    proposal_depth D: drafts the program proposes per lane
    duration_ns    its measured duration (probes compare measured programs only;
                   unknown ones are discovery's business)
    target_rows, batch_capacity: physical geometry, for the last tie-break
    """

    key: Hashable
    width: int
    proposal_depth: int
    duration_ns: int
    target_rows: int
    batch_capacity: int

    def __post_init__(self) -> None:
        if self.width < 1 or self.proposal_depth < 0:
            raise ValueError(f"{self.key}: need width >= 1 and proposal_depth >= 0, got W={self.width}, D={self.proposal_depth}")
        if self.duration_ns <= 0:
            raise ValueError(
                f"{self.key}: probes compare measured programs, duration_ns must be > 0, got {self.duration_ns}"
            )

    @classmethod
    def of(cls, graph: GraphDescriptor, duration_ns: int) -> "WidthProgram":
        return cls(graph.id, graph.width, graph.proposal_depth, duration_ns, graph.target_rows, graph.batch_capacity)

    def offered_depth(self, remaining_output: int) -> int:
        """Drafts this program can verify for the lane: min(W - 1, D, remaining - 1), at least 0."""
        return max(0, min(self.width - 1, self.proposal_depth, remaining_output - 1))


@dataclass(frozen=True, slots=True)
class ProbeLane:
    """One decode lane as probe selection sees it.

    means, weights   the lane's prefix-survival means and aged weights for depths 1..n
    remaining_output tokens it may still emit (output limit and context)
    ordinary         the program ordinary selection chose for it
    token_value      its price per committed token (makes gains comparable across lanes)
    alpha            adaptive_verification_alpha: exponent on survival estimates
    fixed_width      the catalog runs fixed-width speculation: no probes at all
    """

    means: tuple[float, ...]
    weights: tuple[float, ...]
    remaining_output: int
    ordinary: WidthProgram
    token_value: float = 1.0
    alpha: float = 1.0
    fixed_width: bool = False

    def __post_init__(self) -> None:
        if len(self.means) != len(self.weights):
            raise ValueError(f"one weight per mean expected, got {len(self.means)} means and {len(self.weights)} weights")
        if any(not 0.0 <= m <= 1.0 for m in self.means) or any(not w >= 0.0 for w in self.weights):
            raise ValueError("means must be probabilities in [0, 1] and weights >= 0")
        if self.remaining_output < 0 or not self.token_value > 0 or not self.alpha > 0:
            raise ValueError(
                "need remaining_output >= 0, token_value > 0 and alpha > 0, got "
                f"{self.remaining_output}, {self.token_value}, {self.alpha}"
            )

    @classmethod
    def from_estimates(
        cls, estimates: PrefixSurvival, depths: int, remaining_output: int, ordinary: WidthProgram, **options
    ) -> "ProbeLane":
        """Read depths 1..depths of one source's estimates (no state changes)."""
        means, weights = estimates.means_and_weights(depths)
        return cls(means, weights, remaining_output, ordinary, **options)


@dataclass(frozen=True, slots=True)
class ProbeCandidate:
    """A probe worth funding for one lane, with why.

    offered_depth  drafts it verifies (beyond ``ordinary_depth``)
    optimistic_rate, ordinary_rate  value per ms: probe under optimism, ordinary choice under means
    gain_per_ms    (optimistic_rate - ordinary_rate) / probe duration in ms
    added_weight   lowest aged weight among the added depths (how little is known)
    """

    lane: ProbeLane
    program: WidthProgram
    ordinary_depth: int
    offered_depth: int
    optimistic_rate: float
    ordinary_rate: float
    gain_per_ms: float
    added_weight: float

    def rank_key(self) -> tuple:
        p = self.program
        return (-self.gain_per_ms, self.added_weight, p.duration_ns, p.target_rows, p.batch_capacity)


def optimistic(mean: float, weight: float) -> float:
    """S9: min(1, mean + sqrt(ln 20 / (2 * weight))); an unweighted estimate is fully optimistic."""
    return optimistic_survival(mean, weight)


def expected_output(survival: Sequence[float], depth: int, alpha: float) -> float:
    """1 + sum of s_d ** alpha over d = 1..depth, with s kept nonincreasing (S5)."""
    total, envelope = 1.0, 1.0
    for value in survival[:depth]:
        envelope = min(envelope, value)
        total += envelope**alpha
    return total


def _probe_survival(means: Sequence[float], weights: Sequence[float], ordinary_depth: int) -> list[float]:
    """Means where the ordinary choice already offers drafts, optimism on the added depths."""
    known = list(means[:ordinary_depth])
    added = [optimistic_survival(m, w) for m, w in zip(means[ordinary_depth:], weights[ordinary_depth:])]
    return known + added


def _expected_outputs(survival: Sequence[float], alpha: float) -> list[float]:
    """``expected_output(survival, depth, alpha)`` for every depth 0..len(survival), in one pass.

    Each entry is the same running sum ``expected_output`` accumulates, so the
    values are identical to calling it per depth.
    """
    totals, total, envelope = [1.0], 1.0, 1.0
    for value in survival:
        envelope = min(envelope, value)
        total += envelope**alpha
        totals.append(total)
    return totals


def lane_probe_terms(means: Sequence[float], weights: Sequence[float], remaining_output: int, ordinary: WidthProgram,
                     token_value: float, alpha: float,
                     programs: Iterable[WidthProgram]) -> tuple[int, float, list[tuple]]:
    """``_probe_terms`` of a variable-width lane given by ``ProbeLane``'s fields, without building one.

    A decision's probe search reads every decode lane of the winner; it
    builds (and validates) a ``ProbeLane`` only for the lane whose probe wins.
    """
    return priced_probe_terms(probe_basis(means, weights, remaining_output, ordinary, alpha, programs),
                              ordinary, token_value)


@dataclass(frozen=True, slots=True)
class ProbeBasis:
    """What a lane's probe terms depend on apart from its price (``lane_probe_terms`` in two steps).

    ``ordinary_expected`` is the ordinary round's expected output; ``programs``
    holds (program, depth, expected output, least weight of the added depths)
    for each program that adds depth and leaves output to learn for, stably
    sorted by the rank key's price-independent part (weight, duration, rows,
    batch), so that among equal gains the first ranks first. Lanes with the
    same means, weights and (where it limits a depth) room share one.
    """

    ordinary_depth: int
    ordinary_expected: float
    programs: tuple[tuple[WidthProgram, int, float, float], ...]


def probe_basis(means: Sequence[float], weights: Sequence[float], remaining_output: int, ordinary: WidthProgram,
                alpha: float, programs: Iterable[WidthProgram]) -> ProbeBasis | None:
    """The price-independent part of ``lane_probe_terms`` (None: the lane has no output left)."""
    if remaining_output <= 0:
        return None
    ordinary_depth = ordinary.offered_depth(remaining_output)
    expected = _expected_outputs(_probe_survival(means, weights, ordinary_depth), alpha)
    found = []
    for program in programs:
        depth = program.offered_depth(remaining_output)
        if depth <= ordinary_depth or depth + 1 >= remaining_output:
            continue  # adds no depth, or could use up all output and leave nothing to learn for
        if depth > len(means):
            raise ValueError(f"{program.key} offers depth {depth}; the lane has estimates for {len(means)} depths")
        found.append((program, depth, expected[depth], min(weights[ordinary_depth:depth])))
    found.sort(key=lambda p: (p[3], p[0].duration_ns, p[0].target_rows, p[0].batch_capacity))
    return ProbeBasis(ordinary_depth, expected_output(means, ordinary_depth, alpha), tuple(found))


def priced_probe_terms(basis: ProbeBasis | None, ordinary: WidthProgram,
                       token_value: float) -> tuple[int, float, list[tuple]]:
    """``lane_probe_terms`` from its ``probe_basis``: (ordinary depth, ordinary rate, terms).

    The terms come in the basis's order: equal rank keys keep the order they
    would have in the catalog's, so every ranking of them is the same.
    """
    if basis is None:
        return 0, 0.0, []
    ordinary_rate = token_value * basis.ordinary_expected * NS_PER_MS / ordinary.duration_ns
    out = []
    for program, depth, expected, weight in basis.programs:
        rate = token_value * expected * NS_PER_MS / program.duration_ns  # as ordinary_rate is computed
        if rate <= ordinary_rate:
            continue
        gain = (rate - ordinary_rate) * NS_PER_MS / program.duration_ns
        out.append((program, depth, rate, gain, weight))
    return basis.ordinary_depth, ordinary_rate, out


def best_priced_term(basis: ProbeBasis | None, ordinary: WidthProgram,
                     token_value: float) -> tuple[int, float, tuple | None]:
    """``priced_probe_terms`` with only the term ``min(terms, key=term_rank_key)`` picks (None: no term).

    The rank key is (-gain, then price-independent fields) and the terms come
    in the order of those fields, so the best is the first largest gain: one
    scan, no key per term.
    """
    depth, rate, terms = priced_probe_terms(basis, ordinary, token_value)
    best = None
    for term in terms:
        if best is None or term[3] > best[3]:
            best = term
    return depth, rate, best


def term_rank_key(term: tuple) -> tuple:
    """``ProbeCandidate.rank_key`` of the candidate a term would build."""
    program, _, _, gain, weight = term
    return (-gain, weight, program.duration_ns, program.target_rows, program.batch_capacity)


def term_candidate(lane: ProbeLane, ordinary_depth: int, ordinary_rate: float, term: tuple) -> ProbeCandidate:
    """The ``ProbeCandidate`` one of ``lane``'s terms describes."""
    program, depth, rate, gain, weight = term
    return ProbeCandidate(lane, program, ordinary_depth, depth, rate, ordinary_rate, gain, weight)


def rank_probes(candidates: Iterable[ProbeCandidate]) -> list[ProbeCandidate]:
    """Best first: gain per ms, then least-informed added prefix, shorter, smaller (D8)."""
    return sorted(candidates, key=ProbeCandidate.rank_key)


@dataclass(frozen=True, slots=True)
class ExplorationPick:
    """What funded exploration runs next: a stale program's refresh or a lane's probe."""

    reason: SelectionReason
    choice: StaleAlternative | ProbeCandidate


def choose_exploration(
    accounts: ExplorationAccounts, stale: Iterable[StaleAlternative], probes: Iterable[ProbeCandidate]
) -> ExplorationPick | None:
    """Timing refresh first, then an acceptance probe, each only with full credit (D7, D8).

    None means ordinary selection stands: nothing is funded, an episode is in
    flight, or no alternative qualifies.
    """
    if accounts.can_begin(SelectionReason.TIMING_REFRESH):
        alternative = refresh_choice(stale)
        if alternative is not None:
            return ExplorationPick(SelectionReason.TIMING_REFRESH, alternative)
    if accounts.can_begin(SelectionReason.ACCEPTANCE_LEARNING):
        ranked = rank_probes(probes)
        if ranked:
            return ExplorationPick(SelectionReason.ACCEPTANCE_LEARNING, ranked[0])
    return None
