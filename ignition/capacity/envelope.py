"""The capacity envelope: a recipe's defaults with the CLI's overrides applied.

``CapacityOptions`` is what the user asked for (None: the recipe's default);
``CapacityEnvelope`` is the checked result every shape function reads. Both
are frozen; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ignition.capacity.buckets import padded, prompt_buckets_through, request_buckets_through
from ignition.recipes import Recipe
from ignition.recipes.rules import is_power_of_two, prompt_bucket_problem
from ignition.recipes.schema import MAX_REQUEST_SLOTS, PROPOSAL_SOURCES


class CapacityError(ValueError):
    """Options that cannot be planned; the message is one line and says what would work."""


@dataclass(frozen=True, slots=True)
class CapacityOptions:
    """CLI overrides: ``--concurrency --prefill-chunk --drafts --speculative-token-capacity --mixed-prefill``."""

    concurrency: int | None = None
    prefill_chunk: int | None = None
    drafts: int | None = None
    speculative_token_capacity: int | None = None
    mixed_prefill: bool = False


@dataclass(frozen=True, slots=True)
class CapacityEnvelope:
    """Everything the shape functions need, already consistent.

    request_slots      concurrency (slots the runtime may fill).
    request_buckets    power-of-two batch capacities, the largest is the padded concurrency (C5).
    prompt_buckets     prefill chunk capacities, multiples of 64; the last is the prefill chunk.
    draft_depth        D of the widest speculative program; 0: the ordinary catalog only.
    speculative_token_capacity  R: rectangular B*W <= R, ragged P <= R (C5).
    completion_token_capacity   the widest W any program may have (C7; 8 when undeclared).
    mixed              whether mixed prefill+decode programs are planned (C3).
    checkpoint_rows    checkpoint store rows; > 0: snapshot, restore and init at every request bucket.
    """

    request_slots: int
    request_buckets: tuple[int, ...]
    prompt_buckets: tuple[int, ...]
    draft_depth: int
    speculative_token_capacity: int
    completion_token_capacity: int
    mixed: bool
    proposal_sources: tuple[str, ...] = ()
    context_length: int = 0  # 0: unknown (not checked)
    checkpoint_rows: int = 0  # the recipe's checkpoints.rows; > 0 adds the state programs

    def __post_init__(self) -> None:
        problem = _envelope_problem(self)
        if problem:
            raise CapacityError(problem)

    @property
    def prefill_chunk(self) -> int:
        return self.prompt_buckets[-1]

    @property
    def max_width(self) -> int:
        """Widest W, the pending token included."""
        return self.draft_depth + 1

    @property
    def speculative(self) -> bool:
        return self.draft_depth > 0

    def to_dict(self) -> dict:
        """Plain JSON/YAML values (lists, not tuples) plus the derived chunk and width."""
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return plain | {"prefill_chunk": self.prefill_chunk, "max_width": self.max_width}


def _envelope_problem(env: CapacityEnvelope) -> str | None:
    return _slots_problem(env) or _prompt_problem(env) or _speculation_problem(env)


def _slots_problem(env: CapacityEnvelope) -> str | None:
    if not 1 <= env.request_slots <= MAX_REQUEST_SLOTS:
        return f"concurrency {env.request_slots} is outside 1..{MAX_REQUEST_SLOTS}; use 1 through {MAX_REQUEST_SLOTS}"
    buckets, top = env.request_buckets, padded(env.request_slots)
    if any(not is_power_of_two(b) for b in buckets) or list(buckets) != sorted(set(buckets)) or buckets[-1:] != (top,):
        return (f"request buckets {list(buckets)} are not ascending powers of two ending at the padded "
                f"concurrency {top}; use e.g. {list(request_buckets_through(env.request_slots))}")
    return None


def _prompt_problem(env: CapacityEnvelope) -> str | None:
    buckets = env.prompt_buckets
    bad = next((p for p in map(prompt_bucket_problem, buckets) if p), None)
    if bad or not buckets or list(buckets) != sorted(set(buckets)):
        return (f"prompt buckets {list(buckets)}: {bad or 'not a non-empty ascending list'}; "
                "use ascending positive multiples of 64 such as 64, 256, 1024")
    if env.context_length and env.prefill_chunk > env.context_length:
        return (f"prefill chunk {env.prefill_chunk} exceeds the model's context of {env.context_length} tokens; "
                f"use --prefill-chunk <= {env.context_length}")
    return None


def _speculation_problem(env: CapacityEnvelope) -> str | None:
    if env.draft_depth < 0 or env.max_width > env.completion_token_capacity:
        return (f"{env.draft_depth} drafts need width {env.max_width}, outside 1..{env.completion_token_capacity} "
                f"(the completion token capacity); use --drafts 0 through {env.completion_token_capacity - 1}")
    if env.speculative and not set(env.proposal_sources) & set(PROPOSAL_SOURCES):
        return f"--drafts {env.draft_depth} needs a proposal source; the recipe declares none, so use --drafts 0"
    if env.speculative_token_capacity < 1:
        return f"--speculative-token-capacity {env.speculative_token_capacity} is not positive; use R >= 2"
    return None


def resolve_envelope(recipe: Recipe, options: CapacityOptions) -> CapacityEnvelope:
    """Apply ``options`` over ``recipe``'s capacity defaults and check the result."""
    check_options(recipe, options)
    defaults = recipe.capacity
    concurrency = _pick(options.concurrency, defaults.concurrency)
    drafts = _pick(options.drafts, defaults.drafts)
    return CapacityEnvelope(
        request_slots=concurrency,
        request_buckets=request_buckets_through(concurrency, defaults.request_buckets),
        prompt_buckets=prompt_buckets_through(defaults.prompt_buckets, _checked_chunk(options.prefill_chunk)),
        draft_depth=drafts,
        speculative_token_capacity=_pick(
            options.speculative_token_capacity,
            _pick(defaults.speculative_token_capacity, default_token_capacity(concurrency, drafts))),
        completion_token_capacity=defaults.completion_token_capacity,
        mixed=options.mixed_prefill,
        proposal_sources=defaults.proposal_sources,
        context_length=recipe.dims.context_length,
        checkpoint_rows=recipe.checkpoints.rows,
    )


def check_options(recipe: Recipe, options: CapacityOptions) -> None:
    """Option errors that need only the recipe's declarations, not its dimensions."""
    if options.mixed_prefill and not recipe.capacity.mixed_capture:
        raise CapacityError(
            f"--mixed-prefill: recipe {recipe.name!r} does not declare mixed capture (checklist C3); "
            "drop the flag, or use a recipe with mixed_capture: true (e.g. flare-tiny)"
        )


def default_token_capacity(concurrency: int, drafts: int) -> int:
    """R when neither the recipe nor the CLI sets it.

    Large enough that a lone request can verify every draft (R >= D + 1) and
    that the largest request bucket still gets one wider width (R >= 2 * B_max);
    larger R multiplies programs, so no more than that.
    """
    return max(drafts + 1, 2 * padded(concurrency))


def _checked_chunk(chunk: int | None) -> int | None:
    problem = None if chunk is None else prompt_bucket_problem(chunk)
    if problem:
        raise CapacityError(f"--prefill-chunk {problem}; use a multiple of 64 such as 256, 1024 or 4096")
    return chunk


def _pick(override: int | None, default: int) -> int:
    return default if override is None else override
