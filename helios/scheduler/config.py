"""Scheduling preferences (spec "Policy preferences"; checklist Y1, Y2).

These are preferences, not timing measurements or latency bounds. Units: value
is counted in prompt-token units; times in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

POLICY_PRESETS = ("balanced", "throughput")
CHOICE_FIELDS = ("token_rate_by_value", "prompt_chunk_share", "prefill_defers_decode", "age_price_by_cadence",
                 "prompt_outside_rate", "prompts_shortest_first", "queue_ahead_by_host_time",
                 "prompts_beside_decoders", "prompts_by_due", "extrapolate_unobserved_depths",
                 "probes_win_as_plans", "acceptance_from_population", "population_gate_by_evidence",
                 "population_bounds_probes", "prefill_fills_second_slot", "finishing_prompts_fill_rows")

# The spec's three ways to run speculation ("ordinary, fixed-width, and adaptive speculative
# execution"): ``off`` runs no speculative program; ``fixed`` runs one verification width and never
# probes acceptance (D8); ``adaptive`` picks widths and sources per lane and may probe. One tuple for
# the scheduler, the engine (``flare run --speculation``) and simulator traces.
SPECULATION_MODES = ("off", "fixed", "adaptive")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    output_token_value: float = 64.0  # beta: prompt-value units per output token
    token_fairness: float = 16.0  # f: token-rate log-utility coefficient, value/ms
    delivery_fairness: float = 4.0  # g: delivery-rate log-utility coefficient, value/ms
    decode_age_price: float = 0.1  # c: linear output-age cost, value/ms^2
    terminal_value: float = 256.0  # value per terminal retirement
    terminal_age_price: float = 1.0  # linear terminal-wait cost, value/ms^2
    adaptation_ms: float = 100.0  # service-price adaptation time
    estimate_ttl_ns: int = 30_000_000_000  # timing freshness interval
    adaptive_verification_alpha: float = 1.0  # exponent on prefix-survival estimates
    # Price-flow choices (docs/scheduling-utility.md, "Departures from the spec"; issue 20); 0 is the
    # spec text's rule, and every default is the derived one (1).
    # 1: x counts a prompt token as 1/beta output token and a newcomer starts at a batch-feasible share,
    # where the catalog has a mixed program with a prompt row (0, or no such program: one for one)
    token_rate_by_value: int = 1
    prompt_chunk_share: int = 1  # a chunk leaving prompt behind earns its time share of the prompt (0: its tokens)
    # 1: where the catalog has mixed programs, a program that leaves work waiting (decoders outside its
    # batch, prompts beside a decode round) scores no more than itself followed by that work's own
    # frame (0: its own value rate, U6's text; docs/scheduling-utility.md, "The deferred round")
    prefill_defers_decode: int = 1
    # 1: each decoder's age price is at least beta / d^2, d the full-batch decode cadence (its output
    # value per cadence interval, per cadence interval), where the catalog has a mixed program with a
    # prompt row (0, or no such program: decode_age_price alone, Y1's 0.1)
    age_price_by_cadence: int = 1
    # 1: with ``token_rate_by_value`` (where it applies), a consumed prompt token adds nothing to x: a
    # prompt's service counts from its first output, so concurrent prompts keep the order their waiting
    # gave them instead of taking turns (0: 1/beta; docs/scheduling-utility.md, "Prompt service outside
    # x"). Off by default: it trades the long-document ITL tail for their TTFT tail
    prompt_outside_rate: int = 0
    # 1: where the catalog has no mixed program with a prompt row, a program's prompt rows go to the
    # prompters with the least prompt left (equal ones by value), each valued at the highest prompter
    # price; no prompt token is visible before its prompt finishes, so prompts that take turns chunk by
    # chunk all finish late (0, or with such a program: rows go to the best-valued prompters;
    # docs/scheduling-utility.md, "Prompts in order")
    prompts_shortest_first: int = 1
    # 1: a plan is queued behind a running frame (A7's second slot) only while frames run with an empty
    # queue have shown host time to hide (completion wall time above device time); where they show none
    # (the simulator), the next frame is chosen when the running one completes, so requests that arrive
    # meanwhile can join it (0: fill the second slot whenever A7 allows; docs/scheduling-utility.md,
    # "The second frame slot")
    queue_ahead_by_host_time: int = 1
    # 1: while decoders are active, where a measured mixed program carries a prompt row, a prefill-only
    # program holding at most twice that row's capacity is no candidate: its prompt rides beside the
    # decoders instead of making every one of them wait the prefill and their own round after it
    # (0: U6's value rate over every program; docs/scheduling-utility.md, "Departures from the spec")
    prompts_beside_decoders: int = 1
    # 1: where a mixed program carries a prompt row, prompt rows go to the prompters whose prompt would be
    # done soonest if each were prefilled alone from its admission (admission + its least prefill time;
    # earlier first), each row valued at the highest prompter price: first-come first-served among prompts
    # of like length, a short prompt ahead of a long one admitted just before it (0: rows go to the
    # best-valued prompters, which the fairness price makes take turns; docs/scheduling-utility.md,
    # "Departures from the spec")
    prompts_by_due: int = 1
    # 1: a draft depth no completed round has observed for a request reads, in selection and probes, as
    # the survival of the deepest observed depth continued at its conditional rate, s_d = s_(d-1) * s_k /
    # s_(k-1), instead of the prior 0.5**d (0; docs/scheduling-utility.md, "Departures from the spec")
    extrapolate_unobserved_depths: int = 1
    # 1: an acceptance probe (D8) is funded only if, under its optimistic estimate, it would beat the ordinary
    # winner as a plan: the probed lane's priced tokens per ms less U6's waiting cost of every active decoder
    # (0: the lane's own optimistic rate beats its ordinary one; docs/scheduling-utility.md, "Departures from
    # the spec")
    probes_win_as_plans: int = 1
    # 1: where the verified acceptance of every request's completed rounds (per proposal source: a population
    # mean from 0.5**d at weight 2, averaging each round's per-depth outcome, S7's step 1/64 once warm) reads
    # a first draft, even at S9's bound, below the break-even of every measured speculative program
    # (T_spec / T_decode - 1), a new
    # request's estimates start at that population's means instead of S8's 0.5**d, with S8's weight 2; where
    # drafts may pay, the prior stands (0: always the prior; docs/scheduling-utility.md, "Departures from the
    # spec")
    acceptance_from_population: int = 1
    # 1: that gate reads the Chernoff bound at S9's confidence (weight * kl(mean, q) <= ln 20) on the average
    # of the completed rounds alone, without the prior's two rounds at 0.5 (0: S9's Hoeffding bound on the
    # population mean, prior included; docs/scheduling-utility.md, "Departures from the spec")
    population_gate_by_evidence: int = 1
    # 1: a request whose estimates start from that population (the gate open) reads, for funded learning (D8),
    # no more optimism at a depth it has not observed than the population's bound the gate reads: S9's
    # bound on the copied mean is capped there (0: S9's bound at S8's weight 2, +0.87 on the population's
    # mean; docs/scheduling-utility.md, "Departures from the spec")
    population_bounds_probes: int = 1
    # 1: where completed frames have shown host time to hide (as ``queue_ahead_by_host_time`` measures it), an
    # ordinary prefill plan (measured and fresh, prompt rows only, not scored) does not drain the window: it
    # may fill A7's second slot behind a running frame, and an ordinary decode plan may be queued behind it.
    # Its prompters are in no population until it completes, so a finishing prompt's decoder still joins the
    # first plan made after its completion (0: A7's text, prefill drains the window; docs/scheduling-utility.md,
    # "Departures from the spec")
    prefill_fills_second_slot: int = 1
    # 1: a measured decode round gives way to the best measured prefill program whose prompts then decode
    # beside its decoders, where that order (the prefill, then the round holding them, for one adaptation
    # time's rounds) earns more per ms than the round's rounds first, the prefill paying the age it adds
    # to the decoders'; a chunk that leaves prompt behind only if the whole prompt fits that time. Where
    # the new decoders fill idle rows, U6 prices both orders alike but for their lanes (0: U6's value rate
    # alone, which prices the chunk against the round and not the rows it fills;
    # docs/scheduling-utility.md, "Departures from the spec", 16)
    finishing_prompts_fill_rows: int = 1
    # K2 (spec scheduler_checkpoint_extra_work_fraction): extra prefill cuts and snapshot copies fit this
    # share of a request's estimated uncached prefill work
    checkpoint_extra_work_fraction: float = 0.05

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"PolicyConfig.{f.name} must be finite and >= 0, got {value!r}")
        if self.adaptive_verification_alpha <= 0:
            raise ValueError(
                "PolicyConfig.adaptive_verification_alpha must be > 0, "
                f"got {self.adaptive_verification_alpha!r}"
            )
        if self.adaptation_ms <= 0:
            raise ValueError(f"PolicyConfig.adaptation_ms must be > 0, got {self.adaptation_ms!r}")
        for name in CHOICE_FIELDS:
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"PolicyConfig.{name} must be 0 or 1, got {getattr(self, name)!r}")
        if self.checkpoint_extra_work_fraction > 1:
            raise ValueError("PolicyConfig.checkpoint_extra_work_fraction must be in [0, 1], "
                             f"got {self.checkpoint_extra_work_fraction!r}")
        if self.estimate_ttl_ns <= 0:
            raise ValueError(f"PolicyConfig.estimate_ttl_ns must be > 0, got {self.estimate_ttl_ns!r}")

    @property
    def prompt_service_weight(self) -> float:
        """What one consumed prompt token adds to the token rate x, in output tokens.

        1/beta with ``token_rate_by_value`` (x is value-weighted service over beta: a prompt token is
        worth 1, an output token beta), 0 if ``prompt_outside_rate`` is set as well; 1 otherwise, and
        while beta is 0 (no value ratio to weigh by).
        """
        if self.token_rate_by_value and self.output_token_value > 0:
            return 0.0 if self.prompt_outside_rate else 1.0 / self.output_token_value
        return 1.0

    @classmethod
    def preset(
        cls,
        name: str = "balanced",
        *,
        terminal_value: float | None = None,
        terminal_age_price: float | None = None,
        adaptive_verification_alpha: float | None = None,
    ) -> "PolicyConfig":
        """Build a preset, then apply the terminal/alpha overrides (spec Y2 order)."""
        if name == "balanced":
            config = cls()
        elif name == "throughput":
            # keeps token fairness and output-token value; drops cadence preferences
            config = cls(delivery_fairness=0.0, decode_age_price=0.0, prefill_defers_decode=0, age_price_by_cadence=0)
        else:
            raise ValueError(f"unknown scheduler policy {name!r}; expected one of {', '.join(POLICY_PRESETS)}")
        overrides = {
            "terminal_value": terminal_value,
            "terminal_age_price": terminal_age_price,
            "adaptive_verification_alpha": adaptive_verification_alpha,
        }
        return replace(config, **{k: v for k, v in overrides.items() if v is not None})
