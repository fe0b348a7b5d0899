"""Per-request acceptance estimates for speculative rounds (spec "Completed confidence and acceptance").

Checklist S5, S6, S8 and the seams S9/S10 use.

For one request and one proposal source ("learned" draft model, "copy" prompt
lookup) we keep, for every draft depth d = 1, 2, ..., an estimate of the
prefix survival s_d: the probability that the first d proposals are all
accepted. Each depth is an aged running mean:

- It starts at the population prior 0.5**d with weight 2. The spec gives that
  prior for confidence forecasts (S7) and the same starting weight for
  acceptance (S8) without stating a starting mean for acceptance; issue 3 asks
  for the same prior here. Each extra draft halving the chance keeps an
  untrained request's expected output modest (below 2 at any width) while
  still letting a first speculative round be tried. Where the scheduler's
  ``AcceptancePopulation`` shows first drafts that no measured program can
  pay for, a new request starts at its means instead
  (``PolicyConfig.acceptance_from_population``), and funded learning reads
  no more optimism at a depth the request has not observed than the bound
  that showed it (``PolicyConfig.population_bounds_probes``).
- An observation v in [0, 1] moves the mean by (v - mean) / w' where
  w' = min(w + 1, 128): a plain average until 128 observations, then an
  exponential average with step 1/128 (S8's cap).
- Weights age by 0.5 ** (tokens / 128) as the request generates tokens (the
  half-life of S8), so a request's recent behaviour dominates; means of depths
  that receive no observation stay where they are (S8's unobserved suffixes).
  The prior's own weight ages too, so a depth or source first used late starts
  as if it had been created at admission.

A completed verification round with ``offered`` proposals of which the first
``accepted`` were accepted gives 1 at depths 1..accepted and 0 at depths
accepted+1..offered (S6). If the round terminated the request, the rejected
suffix says nothing about the drafts (the output stopped, it did not reject),
so only the accepted prefix is observed. Width-one rounds offer nothing and so
observe nothing. ``observe`` takes per-depth values in [0, 1], so the survival
products of S10 replace the binary values at the depths they cover
(``survival_observations``).

Confidence forecasts (S7) are a second ``PrefixSurvival`` per request, fed
with the program's completed joint-prefix probabilities instead of verified
outcomes. They share the weights, the cap and the aging; their unobserved
depths sit at a scheduler-wide ``PopulationPrior`` that starts at 0.5**d and
moves 1/64 of the way toward every completed prefix probability. Forecast
observations stop at the lane's frozen ceiling min(D + 1, W), read in target
rows: depths 1..ceiling-1 are the drafts that lane could have verified.

S12: ``ProposalDraws`` counts learned-proposal draws for sampling metrics;
copy rounds (prompt lookup) supply a prefix and draw nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_WEIGHT = 2.0
WEIGHT_CAP = 128.0
HALF_LIFE_TOKENS = 128.0
OPTIMISM_LOG_TERM = math.log(20.0)  # S9: mean + sqrt(ln 20 / (2 w))
POPULATION_STEP = 1.0 / 64.0  # S7: the population prior's step toward each completed probability
POPULATION_WEIGHT_CAP = 1.0 / POPULATION_STEP  # ``AcceptancePopulation``: S7's step once warm
PROPOSAL_SOURCES = ("learned", "copy")


def extrapolated_survival(means: Sequence[float], observed: int) -> tuple[float, ...]:
    """``PolicyConfig.extrapolate_unobserved_depths``: depths past the ``observed`` ones continue the
    deepest observed conditional survival (docs/scheduling-utility.md, "Departures from the spec").

    A depth no round has offered sits at the prior mean 0.5**d, so a request whose first drafts are
    accepted 85 % of the time still reads a third draft as 12 % likely; the wider rounds that would
    observe it never win, and the estimate never learns (each request starts over from the prior).
    With at least one observed depth, s_d for d > k (k observed) reads s_(d-1) * q with q = s_k /
    s_(k-1) (s_0 = 1): geometric prefix survival, the shape the observed depths already show.
    Nothing stored changes; without an observed depth the prior stands.
    """
    if observed <= 0 or observed >= len(means):
        return tuple(means)
    deepest = means[observed - 1]
    before = means[observed - 2] if observed >= 2 else 1.0
    ratio = min(1.0, deepest / before) if before > 0.0 else 0.0
    out = list(means)
    for depth in range(observed, len(out)):
        out[depth] = out[depth - 1] * ratio
    return tuple(out)


def prior_survival(depth: int) -> float:
    """The population prior for depth d >= 1: 0.5 ** d."""
    return 0.5**depth


def _check_probabilities(name: str, values: Sequence[float]) -> None:
    for depth, value in enumerate(values, start=1):
        if not 0.0 <= value <= 1.0:  # NaN fails too
            raise ValueError(f"{name} at depth {depth} must be a probability in [0, 1], got {value!r}")


@dataclass(slots=True)
class PopulationPrior:
    """Scheduler-wide starting point of every request's confidence forecast (S7).

    Depth d starts at 0.5**d and moves 1/64 of the way toward each completed
    joint-prefix probability observed at that depth, from any request.
    """

    means: list[float] = field(default_factory=list)
    # per depth, an upper confidence bound on the survival these means estimate, where they are a copy of an
    # ``AcceptancePopulation`` (``PolicyConfig.population_bounds_probes``); a depth without one is unbounded
    bounds: list[float] = field(default_factory=list)
    # depth -> ``bounded_weight(mean(depth), bounds[depth - 1])``, read once per depth while the means stand
    _bounded_weights: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    def mean(self, depth: int) -> float:
        _check_depth(depth)
        return self.means[depth - 1] if depth <= len(self.means) else prior_survival(depth)

    def bounded_weight(self, depth: int) -> float:
        """The weight at which S9's bound on ``mean(depth)`` reaches ``bounds[depth - 1]`` (``bounded_weight``).
        A request's start is a copy that nothing observes, so each of its unobserved depths reads this on every
        plain round; it is computed once per depth while the means stand."""
        found = self._bounded_weights.get(depth)
        if found is None:
            found = self._bounded_weights[depth] = bounded_weight(self.mean(depth), self.bounds[depth - 1])
        return found

    def observe(self, probabilities: Sequence[float]) -> None:
        """One lane's completed prefix probabilities, ``probabilities[d - 1]`` at depth d."""
        _check_probabilities("joint-prefix probability", probabilities)
        self._bounded_weights.clear()
        while len(self.means) < len(probabilities):
            self.means.append(prior_survival(len(self.means) + 1))
        for index, value in enumerate(probabilities):
            self.means[index] += (value - self.means[index]) * POPULATION_STEP


@dataclass(slots=True)
class AcceptancePopulation:
    """Verified acceptance of every completed round of one proposal source, scheduler-wide
    (``PolicyConfig.acceptance_from_population``; docs/scheduling-utility.md, "Departures from the spec").

    Depth d has S8's starting point without the aging: the prior 0.5**d at weight 2, then a plain average
    of the rounds' per-depth outcomes v, (v - mean) / w' with w' = min(w + 1, 64), so the prior counts as
    two rounds until the population has data, and once warm each round moves it by S7's step, 1/64.
    ``start()`` is what a new request's estimates may start from: a copy, so that later rounds of other
    requests do not move an admitted request's unobserved depths (S8: they keep their means).
    """

    depths: list[PrefixEstimate] = field(default_factory=list)
    # per depth, the same average of the rounds alone, without the prior's two rounds: what
    # ``evidence_bound`` reads (mean 0 at weight 0 until a round arrives)
    evidence: list[PrefixEstimate] = field(default_factory=list)

    def observe(self, values: Sequence[float]) -> None:
        """One completed round's per-depth outcome, ``values[d - 1]`` at depth d (S6, S10)."""
        _check_probabilities("acceptance observation", values)
        while len(self.depths) < len(values):
            self.depths.append(PrefixEstimate(prior_survival(len(self.depths) + 1)))
            self.evidence.append(PrefixEstimate(0.0, 0.0))
        for averages in (self.depths, self.evidence):
            for estimate, value in zip(averages, values):
                estimate.weight = min(estimate.weight + 1.0, POPULATION_WEIGHT_CAP)
                estimate.mean += (value - estimate.mean) / estimate.weight

    def evidence_bound(self, depth: int) -> float:
        """An upper confidence bound on the population's survival at ``depth`` from its rounds alone, at S9's
        level: the Chernoff (relative-entropy) bound ``chernoff_upper(mean, w)`` of their average (1.0 before
        any round; ``PolicyConfig.population_gate_by_evidence``)."""
        _check_depth(depth)
        if depth > len(self.evidence):
            return 1.0
        estimate = self.evidence[depth - 1]
        return chernoff_upper(estimate.mean, estimate.weight)

    def mean(self, depth: int) -> float:
        _check_depth(depth)
        return self.depths[depth - 1].mean if depth <= len(self.depths) else prior_survival(depth)

    def optimistic(self, depth: int) -> float:
        """S9's bound on the population mean at ``depth``: min(1, mean + sqrt(ln 20 / (2 w)))."""
        _check_depth(depth)
        if depth > len(self.depths):
            return optimistic_survival(prior_survival(depth), PRIOR_WEIGHT)
        return self.depths[depth - 1].optimistic()

    def start(self, bounded: bool = False, by_evidence: bool = True) -> PopulationPrior:
        """The means a new request's unobserved depths start at (depths never observed: 0.5**d).

        ``bounded`` (``PolicyConfig.population_bounds_probes``): the copy also keeps, per depth, the upper
        confidence bound the gate reads, ``evidence_bound`` (``by_evidence``) or S9's ``optimistic``, so that
        funded learning reads no more optimism into a copied mean than the population's evidence allows."""
        means = [estimate.mean for estimate in self.depths]
        if not bounded:
            return PopulationPrior(means)
        read = self.evidence_bound if by_evidence else self.optimistic
        return PopulationPrior(means, [read(depth) for depth in range(1, len(self.depths) + 1)])


@dataclass(slots=True)
class PrefixEstimate:
    """One depth's aged mean: probability that this whole prefix is accepted."""

    mean: float
    weight: float = PRIOR_WEIGHT

    def observe(self, value: float) -> None:
        self.weight = min(self.weight + 1.0, WEIGHT_CAP)
        self.mean += (value - self.mean) / self.weight

    def optimistic(self) -> float:
        """Upper confidence bound min(1, mean + sqrt(ln 20 / (2 w))) (S9)."""
        return optimistic_survival(self.mean, self.weight)


def bounded_weight(mean: float, bound: float) -> float:
    """The weight w at which S9's bound mean + sqrt(ln 20 / (2 w)) equals ``bound`` (inf where the bound
    is at or below the mean: no optimism at all)."""
    if bound <= mean:
        return math.inf
    return OPTIMISM_LOG_TERM / (2.0 * (bound - mean) ** 2)


def bernoulli_divergence(p: float, q: float) -> float:
    """kl(p, q) = p ln(p/q) + (1-p) ln((1-p)/(1-q)) for p, q in [0, 1] (0 ln 0 = 0; inf where q excludes p)."""
    total = 0.0
    if p > 0.0:
        if q <= 0.0:
            return math.inf
        total += p * math.log(p / q)
    if p < 1.0:
        if q >= 1.0:
            return math.inf
        total += (1.0 - p) * math.log((1.0 - p) / (1.0 - q))
    return total


def chernoff_upper(mean: float, weight: float, log_term: float = OPTIMISM_LOG_TERM) -> float:
    """The largest q >= mean with weight * kl(mean, q) <= log_term: the Chernoff bound for an average of
    ``weight`` outcomes in [0, 1] at S9's confidence (ln 20), by bisection to 1e-12. It is never above
    S9's Hoeffding form mean + sqrt(ln 20 / (2 w)) (Pinsker: kl(p, q) >= 2 (q - p)^2) and far below it
    near 0: after n rejections alone it is 1 - 20^(-1/n) (0.21 at n = 14) against sqrt(ln 20 / (2 n))
    (0.33). Weight 0: 1.0."""
    if weight <= 0.0:
        return 1.0
    budget = log_term / weight
    low, high = mean, 1.0
    if bernoulli_divergence(mean, high) <= budget:
        return 1.0
    while high - low > 1e-12:
        middle = 0.5 * (low + high)
        if bernoulli_divergence(mean, middle) <= budget:
            low = middle
        else:
            high = middle
    return low


def optimistic_survival(mean: float, weight: float) -> float:
    """``PrefixEstimate(mean, weight).optimistic()`` without building one (probe ranking reads many)."""
    if weight <= 0.0:
        return 1.0
    return min(1.0, mean + math.sqrt(OPTIMISM_LOG_TERM / (2.0 * weight)))


def round_observations(offered: int, accepted: int, terminated: bool) -> tuple[float, ...]:
    """Binary per-depth observations of one completed round (S6).

    ``offered``: proposals verified for the lane (0 for width one);
    ``accepted``: length of the accepted prefix (0..offered);
    ``terminated``: the round ended the request, which censors the rejected suffix.
    """
    if offered < 0 or not 0 <= accepted <= offered:
        raise ValueError(f"need 0 <= accepted <= offered, got accepted={accepted}, offered={offered}")
    accepted_part = (1.0,) * accepted
    if terminated:
        return accepted_part
    return accepted_part + (0.0,) * (offered - accepted)


def survival_observations(
    offered: int, accepted: int, terminated: bool, survival: Sequence[float] | None
) -> tuple[float, ...]:
    """A round's per-depth observations with survival products in place of binary ones (S10).

    ``survival[d - 1]`` is the program's cumulative product of min(1, p/q)
    through draft d. It replaces the binary value at every depth the round
    observes and the row covers; it never adds depths the round did not
    observe (unoffered drafts, or a suffix censored by termination).
    """
    binary = round_observations(offered, accepted, terminated)
    if survival is None:
        return binary
    _check_probabilities("survival", survival)
    covered = min(len(survival), len(binary))
    return tuple(survival[:covered]) + binary[covered:]


def rank_zero_confidence(per_rank: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """The confidence row that drives decisions: rank zero's, after checking every rank (S11).

    Peers need not agree bitwise with rank zero, but each must hold valid
    probabilities; a malformed peer means a broken program, so it is an error.
    """
    if not per_rank:
        raise ValueError("confidence needs one row per rank (rank zero first), got none")
    for rank, row in enumerate(per_rank):
        _check_probabilities(f"rank {rank} confidence", row)
    return tuple(float(p) for p in per_rank[0])


def forecast_observations(probabilities: Sequence[float], ceiling: int) -> tuple[float, ...]:
    """The prefix probabilities a lane's forecast may learn from: depths below its ceiling (D8, S7).

    ``ceiling`` is the lane's frozen min(D + 1, W) in target rows, the
    pending token included, so the lane could verify at most ceiling - 1 drafts.
    """
    if ceiling < 1:
        raise ValueError(f"a lane ceiling counts target rows and is >= 1, got {ceiling}")
    return tuple(probabilities[: ceiling - 1])


@dataclass(frozen=True, slots=True)
class OutputBounds:
    """What caps one round's output for one lane (S5).

    proposal_depth  proposals the program actually produces (D; copy: supplied prefix)
    output_remaining tokens the request may still emit (max_tokens left)
    context_remaining positions left before the context limit
    """

    proposal_depth: int
    output_remaining: int
    context_remaining: int


def aging_factor(generated_tokens: int) -> float:
    """Weight kept after the request generates this many tokens: 0.5 ** (n / 128)."""
    if generated_tokens < 0:
        raise ValueError(f"generated_tokens must be >= 0, got {generated_tokens}")
    return 0.5 ** (generated_tokens / HALF_LIFE_TOKENS)


def _check_depth(depth: int) -> None:
    if depth < 1:
        raise ValueError(f"draft depth starts at 1, got {depth}")


@dataclass(slots=True)
class PrefixSurvival:
    """Prefix-survival estimates s_1, s_2, ... for one request and one source.

    Depths never observed are not stored: they sit at the prior mean 0.5**d
    with ``prior_weight``, which starts at 2 and ages like every other weight,
    so the state depends only on the request's history, never on which depths
    were read. There is no fixed maximum depth.
    """

    depths: list[PrefixEstimate] = field(default_factory=list)
    prior_weight: float = PRIOR_WEIGHT
    population: PopulationPrior | None = None  # forecasts (S7): prior means come from here

    def _prior_mean(self, depth: int) -> float:
        return self.population.mean(depth) if self.population is not None else prior_survival(depth)

    def _unobserved_weight(self, depth: int) -> float:
        """The weight funded learning reads behind an unobserved depth: S8's aged prior weight, or, where the
        start is a population copy with a bound (``PopulationPrior.bounds``), at least the weight at which S9's
        bound, mean + sqrt(ln 20 / (2 w)), reaches that bound (``PolicyConfig.population_bounds_probes``): the
        copied mean is the population's, and no more is known of this request than the population shows."""
        population = self.population
        if population is None or depth > len(population.bounds):
            return self.prior_weight
        return max(self.prior_weight, population.bounded_weight(depth))

    def _estimate(self, depth: int) -> PrefixEstimate:
        """The stored estimate at ``depth``, or a detached prior one (reads never store)."""
        _check_depth(depth)
        if depth <= len(self.depths):
            return self.depths[depth - 1]
        mean = self._prior_mean(depth)
        return PrefixEstimate(mean, self._unobserved_weight(depth))

    def _stored(self, depth: int) -> PrefixEstimate:
        _check_depth(depth)
        while len(self.depths) < depth:
            self.depths.append(PrefixEstimate(self._prior_mean(len(self.depths) + 1), self.prior_weight))
        return self.depths[depth - 1]

    def survival(self, depth: int) -> float:
        """Mean estimate of s_depth (used by ordinary selection)."""
        return self._estimate(depth).mean

    def weight(self, depth: int) -> float:
        """Aged weight behind ``survival(depth)`` (how informed that prefix is)."""
        return self._estimate(depth).weight

    def optimistic(self, depth: int) -> float:
        """S9's bounded optimistic estimate for funded acceptance learning."""
        return self._estimate(depth).optimistic()

    def observe(self, values: Sequence[float]) -> None:
        """One completed round: ``values[d - 1]`` is the observation at depth d.

        Binary values come from ``round_observations``; survival products
        (cumulative min(1, p/q), S10) may be passed instead. Depths beyond
        ``len(values)`` are untouched.
        """
        for depth, value in enumerate(values, start=1):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"acceptance observation at depth {depth} must be in [0, 1], got {value!r}")
        for depth, value in enumerate(values, start=1):
            self._stored(depth).observe(value)

    def weights(self, depths: int) -> tuple[float, ...]:
        """Aged weights of depths 1..depths (how informed each prefix is; probes rank by it)."""
        return tuple(self.weight(depth) for depth in range(1, depths + 1))

    def means(self, depths: int) -> tuple[float, ...]:
        """Means of depths 1..depths as stored (no envelope applied)."""
        return tuple(self.survival(depth) for depth in range(1, depths + 1))

    def means_and_weights(self, depths: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``means(depths)`` and ``weights(depths)``, each depth read once (probe selection reads both)."""
        stored = self.depths[: max(depths, 0)]
        unstored = range(len(stored) + 1, depths + 1)  # at the prior, as ``_estimate`` reads them
        means = tuple([e.mean for e in stored] + [self._prior_mean(d) for d in unstored])
        weights = [e.weight for e in stored] + [self._unobserved_weight(d) for d in unstored]
        return means, tuple(weights)

    def aged_weights(self, weights: Sequence[float], factor: float) -> tuple[float, ...]:
        """``means_and_weights(len(weights))[1]`` after ``age``, where ``weights`` is what it read before and
        ``factor`` the aging's (no observation between): a stored depth's weight and the prior weight were
        each multiplied by ``factor``, so those are the same products, and only an unobserved depth under a
        bounded start (``_unobserved_weight``) is read again. The means do not move."""
        stored = len(self.depths)
        if self.population is None or not self.population.bounds or stored >= len(weights):
            return tuple([w * factor for w in weights])
        return tuple([w * factor for w in weights[:stored]]
                     + [self._unobserved_weight(d) for d in range(stored + 1, len(weights) + 1)])

    def age(self, generated_tokens: int) -> None:
        """Decay every depth's weight, the prior's included, for tokens generated (half-life 128)."""
        self.age_by(aging_factor(generated_tokens))

    def age_by(self, factor: float) -> None:
        """``age`` with its ``aging_factor`` already computed (the same products)."""
        self.prior_weight *= factor
        for estimate in self.depths:
            estimate.weight *= factor

    def seed(self, means: Sequence[float], weight: float) -> None:
        """Replace the first ``len(means)`` depths (e.g. a preseeded history)."""
        for depth, mean in enumerate(means, start=1):
            if not 0.0 <= mean <= 1.0 or not 0.0 < weight <= WEIGHT_CAP:
                raise ValueError(f"seed needs means in [0, 1] and 0 < weight <= {WEIGHT_CAP}")
            estimate = self._stored(depth)
            estimate.mean, estimate.weight = float(mean), float(weight)

    def expected_output(self, width: int, alpha: float, bounds: OutputBounds) -> float:
        """Expected committed tokens of one round at verification width W (S5).

        1 + sum_{i=1}^{n} s_i ** alpha, where n = min(W - 1, D, L - 1) and
        L = min(output_remaining, context_remaining). Truncating the sum (rather
        than clipping the total at L) is the exact expectation of
        min(1 + accepted, L). Survival cannot rise with depth, so each term uses
        the running minimum of the means: independently estimated depths can
        cross when shallow depths were observed more often than deep ones.
        0 when the request can emit nothing.
        """
        return self.expected_output_by_width(width, alpha, bounds)[width - 1]

    def expected_output_by_width(self, max_width: int, alpha: float, bounds: OutputBounds) -> tuple[float, ...]:
        """``expected_output`` for every width 1..max_width in one pass (index W - 1)."""
        if max_width < 1 or alpha <= 0:
            raise ValueError(f"need width >= 1 and alpha > 0, got width={max_width}, alpha={alpha}")
        limit = min(bounds.output_remaining, bounds.context_remaining)
        if limit <= 0:
            return (0.0,) * max_width
        terms = min(max_width - 1, bounds.proposal_depth, limit - 1)
        totals, envelope = [1.0], 1.0
        for depth in range(1, terms + 1):
            envelope = min(envelope, self.survival(depth))
            totals.append(totals[-1] + envelope**alpha)
        totals.extend([totals[-1]] * (max_width - len(totals)))  # wider rounds add nothing
        return tuple(totals)


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class CompletedRound:
    """One lane's validated outcome of one completed round, as the estimates need it.

    source           proposal source ("learned", "copy"); None for an ordinary decode row
    generated_tokens tokens the round committed for the lane (ages every estimate)
    offered          drafts verified for the lane; accepted: its accepted prefix
    terminated       the round ended the request (censors the rejected suffix)
    survival         completion_speculative_survival row, if the program wrote one (S10)
    confidence       joint-prefix probabilities, one row per rank, rank zero first (S7, S11)
    ceiling          the lane's frozen min(D + 1, W) (prefix-limit rounds; needed with confidence)
    """

    source: str | None
    generated_tokens: int
    offered: int = 0
    accepted: int = 0
    terminated: bool = False
    survival: tuple[float, ...] | None = None
    confidence: tuple[tuple[float, ...], ...] | None = None
    ceiling: int = 0


@dataclass(slots=True)
class RequestAcceptance:
    """A request's acceptance estimates, one ``PrefixSurvival`` per proposal source (S6),
    and its confidence forecast (S7) once a confidence-producing round completes.

    A source (or the forecast) first used late starts from the prior aged by
    everything the request generated so far, the same state it would have had
    if created at admission.
    """

    by_source: dict[str, PrefixSurvival] = field(default_factory=dict)
    prior_weight: float = PRIOR_WEIGHT
    forecast: PrefixSurvival | None = None
    # where each source's unobserved depths start: a copy of the scheduler's verified-acceptance population
    # taken at admission (``PolicyConfig.acceptance_from_population``); a source without one starts at 0.5**d
    starts: dict[str, PopulationPrior] = field(default_factory=dict)

    def forecast_estimates(self, population: PopulationPrior) -> PrefixSurvival:
        """The request's forecast of joint-prefix probabilities (S7), for reading.

        Before its first confidence round this is a detached prior (stored
        nowhere): only completed rounds change forecasts (S11).
        """
        if self.forecast is None:
            return PrefixSurvival(prior_weight=self.prior_weight, population=population)
        return self.forecast

    def complete(self, outcome: CompletedRound, population: PopulationPrior | None = None) -> None:
        """Everything one completed round does to this request's estimates, in order.

        Age by the committed tokens; fold the verified outcome (survival
        products where the program wrote them); then, for a confidence round,
        fold rank zero's prefix probabilities below the lane's ceiling into
        the forecast and, after that, into the population prior. Rows are
        validated before anything changes.
        """
        observations = survival_observations(outcome.offered, outcome.accepted, outcome.terminated, outcome.survival)
        forecast = self._forecast_row(outcome, population)
        self.age(outcome.generated_tokens)
        if outcome.source is not None and observations:
            self.source(outcome.source).observe(observations)
        if forecast:
            if self.forecast is None:
                self.forecast = PrefixSurvival(prior_weight=self.prior_weight, population=population)
            self.forecast.observe(forecast)
            population.observe(forecast)

    @staticmethod
    def _forecast_row(outcome: CompletedRound, population: PopulationPrior | None) -> tuple[float, ...]:
        if outcome.confidence is None:
            return ()
        if population is None:
            raise ValueError("a round with confidence rows needs the scheduler's PopulationPrior")
        return forecast_observations(rank_zero_confidence(outcome.confidence), outcome.ceiling)

    def source(self, name: str) -> PrefixSurvival:
        """The estimates for ``name`` ("learned", "copy")."""
        estimates = self.by_source.get(name)
        if estimates is None:
            estimates = self.by_source[name] = self._fresh(name)
        return estimates

    def reading(self, name: str) -> PrefixSurvival:
        """``source(name)`` for reading only: an unused source is a detached fresh one, stored nowhere."""
        return self.by_source.get(name) or self._fresh(name)

    def _fresh(self, name: str) -> PrefixSurvival:
        return PrefixSurvival(prior_weight=self.prior_weight, population=self.starts.get(name))

    def observe_round(self, source: str, offered: int, accepted: int, terminated: bool) -> None:
        """Fold one completed round's binary outcome into ``source``'s estimates."""
        observations = round_observations(offered, accepted, terminated)
        if observations:
            self.source(source).observe(observations)

    def complete_round(
        self, source: str | None, generated_tokens: int, offered: int, accepted: int, terminated: bool
    ) -> None:
        """Everything one completed round does to the estimates, in order.

        First age every source by the tokens the round committed, then fold in
        the round's outcome, so the new observation carries full weight.
        ``source`` None (an ordinary decode round) only ages. ``terminated``:
        the round ended the request (end of sequence, or a limit cut the
        accepted prefix), which censors the rejected suffix.
        """
        self.age(generated_tokens)
        if source is not None:
            self.observe_round(source, offered, accepted, terminated)

    def age(self, generated_tokens: int) -> None:
        """Age every source, and the forecast, by tokens the request generated (any phase, any source)."""
        self.age_by(aging_factor(generated_tokens))

    def age_by(self, factor: float) -> None:
        """``age`` with its ``aging_factor`` computed once for the request, its sources and its forecast
        (each used to compute the same float again)."""
        self.prior_weight *= factor
        for estimates in self.by_source.values():
            estimates.age_by(factor)
        if self.forecast is not None:
            self.forecast.age_by(factor)


@dataclass(slots=True)
class ProposalDraws:
    """Sampling-metric counts of proposals (S12).

    ``learned_draws`` counts candidate positions a learned draft produced
    (greedy ones included): the program's D for every active lane. A copy
    round supplies a prompt-lookup prefix that D only bounds; it draws
    nothing, so it only adds to ``copy_rounds``.
    """

    learned_draws: int = 0
    copy_rounds: int = 0

    def record(self, source: str, lanes: int, proposal_depth: int) -> None:
        if source not in PROPOSAL_SOURCES:
            raise ValueError(f"unknown proposal source {source!r}; expected one of {PROPOSAL_SOURCES}")
        if lanes < 0 or proposal_depth < 0:
            raise ValueError(f"lanes and proposal_depth must be >= 0, got {lanes}, {proposal_depth}")
        if source == "learned":
            self.learned_draws += lanes * proposal_depth
        else:
            self.copy_rounds += 1
