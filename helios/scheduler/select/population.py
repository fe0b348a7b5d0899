"""Selection's input: a columnar snapshot of the runnable population (spec "Useful service and selection").

The core builds one ``Population`` per decision from request state and prices:
``Decoders`` and ``Prompters`` are parallel columns, least recently selected
first, so that selection ranks lanes without touching request objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from helios.scheduler.types import RequestHandle
from helios.scheduler.utility import PrefillTimes

MAX_REQUEST_SLOTS = 64  # U11: selection is bounded to 64 request slots


@dataclass(slots=True)
class Lanes:
    """Columns every lane kind has: the request and when it was last selected (U8's tie order).

    Both lists of a ``Population`` are least recently selected first.
    """

    handle: list[RequestHandle] = field(default_factory=list)
    recency: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.handle)


@dataclass(slots=True)
class Decoders(Lanes):
    """Runnable decoding requests, least recently selected first (U8 tie order).

    token_price     beta + f/x      delivery_price  g/z
    age_credit      c_i*sigma_i*A_i (A projected to the planning start, A10)
    age_slope       c_i*sigma_i     (multiplies the graph duration T)
    room            output tokens the request may still commit after queued work
    survival        per proposal source, prefix-survival means 1 >= s_1 >= s_2 >= ... >= 0 (S5: a longer
                    prefix never survives more often; selection's bounds and shortcuts rely on it)
    gains           optional, per proposal source: ``cumulative_gains(survival, alpha)``,
                    for callers that keep it between decisions (empty: computed here)
    estimates       optional, per proposal source: (means, weights) of the request's estimates
                    at depths 1..D (``PrefixSurvival.means_and_weights``), which the acceptance
                    probe search reads (D8; empty: it asks for each lane's estimates)
    """

    token_price: list[float] = field(default_factory=list)
    delivery_price: list[float] = field(default_factory=list)
    age_credit: list[float] = field(default_factory=list)
    age_slope: list[float] = field(default_factory=list)
    room: list[int] = field(default_factory=list)
    survival: list[Mapping[str, Sequence[float]]] = field(default_factory=list)
    gains: list[Mapping[str, Sequence[float]]] = field(default_factory=list)
    estimates: list[Mapping[str, tuple[Sequence[float], Sequence[float]]]] = field(default_factory=list)


def cumulative_gains(survival: Sequence[float], alpha: float) -> list[float]:
    """0, s_1**a, s_1**a + s_2**a, ...: expected extra tokens of the first d drafts in selection (S5)."""
    row = [0.0]
    for p in survival:
        row.append(row[-1] + p ** alpha)
    return row


@dataclass(slots=True)
class Prompters(Lanes):
    """Requests with uncached prompt left, least recently selected first.

    start        first prompt position not yet consumed (queued work included)
    remaining    prompt tokens left
    to_endpoint  tokens up to the next message/system endpoint or the prompt end
    price        1 + f/x
    first_token  value of the one output token a finishing prompt can publish
    times        the catalog's least known prefill times (``utility.PrefillTimes``) for the chunk share
                 of ``utility.prompt_chunk_value``; None: a chunk earns its tokens (the spec's U13 text)
    """

    start: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    to_endpoint: list[int] = field(default_factory=list)
    price: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    times: PrefillTimes | None = None
    due: list[float] = field(default_factory=list)  # admission + least prefill time of the whole prompt, ms


@dataclass(slots=True)
class Population:
    decoders: Decoders
    prompters: Prompters
    active_age_price: float  # sum of c_i over every active decoder (U6 waiting cost)
    alpha: float = 1.0  # adaptive_verification_alpha (S5)
    # Facts a caller may vouch for, so that a decision need not scan for them (False: it checks).
    # ``ordered``: both lists are least recently selected first (their ``recency`` nondecreasing);
    # ``uniform_slope``: every decoder has the same ``age_slope``; ``positive``: every token price
    # is > 0 and every delivery price and age credit >= 0 (as prices with beta > 0 always are).
    ordered: bool = False
    uniform_slope: bool = False
    positive: bool = False
    # ``PolicyConfig.prefill_defers_decode``: charge a prefill-only program the decode round it defers
    # (``scorers.charge_deferred_round``); False, as for a population built elsewhere, is U6's own rate
    defers_decode: bool = False
    # ``PolicyConfig.prompts_beside_decoders``: with decoders active, prefill-only programs that a mixed
    # prompt row could stand in for are no candidates (``scorers.drop_prefill_beside_decoders``)
    prompts_beside_decoders: bool = False
    # ``PolicyConfig.prompts_shortest_first``: prompt rows go to the prompters with the least prompt
    # left (``rankings.DecisionRankings.prompt_ranking``); False ranks them by value
    shortest_prompts_first: bool = False
    # ``PolicyConfig.prompts_by_due``: prompt rows go to the prompters of the earliest ``Prompters.due``
    # (``rankings.DecisionRankings.prompt_ranking``); takes precedence over ``shortest_prompts_first``
    prompts_by_due: bool = False
    # ``PolicyConfig.finishing_prompts_fill_rows``: a measured decode winner gives way to the best measured
    # prefill program whose prompts then join its round, where that order earns more (``leader.select``)
    prompts_join_rounds: bool = False
    age_price: float = 0.0  # c (U6), every decoder's: the cost per ms of a decoder's age A is c*A
    adaptation_ms: float = 0.0  # PolicyConfig.adaptation_ms: the time over which prices move
    # Prompters whose prompt must be scored (``AdmitRequest.scored_prompt``): ranked only for
    # SCORED_PREFILL programs, as ``prompters`` are for prefill and mixed ones (None: nobody)
    scored: Prompters | None = None
