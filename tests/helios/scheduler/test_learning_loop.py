"""The exploration leaves in a closed loop: one request, a width ladder, shifting acceptance.

Checklist D8, S9 (probes let the width follow a rise in acceptance that
ordinary selection alone never sees) and D6/D8's share of device time. The
loop stands in for the core: ordinary choice by mean value rate, probes from
``learning.py`` funded by ``refresh.py``, estimates from ``speculation.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from helios.scheduler.learning import ProbeLane, WidthProgram
from helios.scheduler.refresh import ExplorationAccounts
from helios.scheduler.speculation import CompletedRound, OutputBounds, RequestAcceptance
from helios.scheduler.types import ExecutionTiming, SelectionReason
from tests.helios.scheduler.reference import probe_candidates

MS = 1_000_000
LADDER = (
    WidthProgram("w1", 1, 0, 10 * MS, 1, 1),
    WidthProgram("w2", 2, 1, 12 * MS, 2, 1),
    WidthProgram("w3", 3, 2, 13 * MS, 3, 1),
    WidthProgram("w5", 5, 4, 16 * MS, 5, 1),
)
DEPTH = 4
ROOM = 1_000_000  # an effectively endless request


@dataclass
class Loop:
    """The state of one simulated request and the device."""

    learn: bool
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)
    accounts: ExplorationAccounts = field(default_factory=ExplorationAccounts)
    tokens: int = 0
    probes: int = 0

    def ordinary(self) -> WidthProgram:
        estimates = self.acceptance.source("learned")
        bounds = OutputBounds(DEPTH, ROOM, ROOM)
        return max(LADDER, key=lambda p: estimates.expected_output(p.width, 1.0, bounds) / p.duration_ns)

    def step(self, true_acceptance: float) -> WidthProgram:
        """One round; returns the ordinary choice it started from."""
        choice = self.ordinary()
        program, reason = choice, SelectionReason.ORDINARY
        if self.learn and self.accounts.can_begin(SelectionReason.ACCEPTANCE_LEARNING):
            lane = ProbeLane.from_estimates(self.acceptance.source("learned"), DEPTH, ROOM, choice)
            found = probe_candidates(lane, LADDER)
            if found:
                program, reason = found[0].program, SelectionReason.ACCEPTANCE_LEARNING
                self.accounts.begin(reason)
                self.probes += 1
        self.run(program, reason, true_acceptance)
        return choice

    def run(self, program: WidthProgram, reason: SelectionReason, p: float) -> None:
        offered = min(program.width - 1, program.proposal_depth)
        accepted = 0
        while accepted < offered and self.rng.random() < p:
            accepted += 1
        self.acceptance.complete(CompletedRound("learned", accepted + 1, offered, accepted))
        self.accounts.record(reason, ExecutionTiming(program.duration_ns, program.duration_ns), queued=False)
        self.tokens += accepted + 1


def tokens_until_wide(loop: Loop, low_tokens: int, limit: int) -> int | None:
    """Train at low acceptance, switch to high; tokens until ordinary selection goes wider than one."""
    while loop.tokens < low_tokens:
        loop.step(0.05)
    assert loop.ordinary().width == 1, "low acceptance should settle on plain decode"
    start = loop.tokens
    while loop.tokens - start < limit:
        if loop.step(0.95).width > 1:
            return loop.tokens - start
    return None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_D8_S9_width_follows_a_rise_in_acceptance_within_a_bounded_number_of_tokens(seed):
    # plain decode runs 10 ms a token, so the ledger funds a probe at most every 50 tokens;
    # the width must follow within a handful of those periods
    followed = tokens_until_wide(Loop(learn=True, rng=random.Random(seed)), low_tokens=3_000, limit=3_000)
    assert followed is not None and followed <= 500


def test_D8_without_probes_the_width_never_follows():
    assert tokens_until_wide(Loop(learn=False), low_tokens=3_000, limit=3_000) is None


def test_D8_learning_spends_about_one_percent_of_device_time():
    loop = Loop(learn=True)
    for round_ in range(4_000):
        loop.step(0.05 if round_ < 2_000 else 0.95)
    counters = loop.accounts.counters
    ordinary = counters.nanoseconds(SelectionReason.ORDINARY)
    learning = counters.nanoseconds(SelectionReason.ACCEPTANCE_LEARNING)
    assert loop.probes > 0
    assert learning <= ordinary / 99 + 16 * MS  # D8's bound, one episode of overrun
