"""What the HTTP server needs from the runtime engine, and nothing more.

The server (``helios.server``) turns OpenAI-shaped HTTP requests into
``GenerationRequest``s, hands them to an ``Engine`` and relays the
``TextDelta``s it yields. Everything about scheduling, execution, paged KV,
detokenization and stop strings lives behind this interface, so the server can
be tested against a fake (``tests/server/fake_engine.py``) and the engine
without HTTP.

Contract, in the order a request lives:

1. ``submit(request)`` is a plain method: it accepts or refuses at once,
   raising ``RequestRejected`` (the engine cannot serve this request: a 400)
   or ``EngineUnavailable`` (draining, or ``EngineOverloaded``: too many
   requests already wait for a slot; a 503, with ``Retry-After`` when the
   exception carries ``retry_after_s``), and otherwise returns an async
   iterator of ``TextDelta``. Refusing at once is what lets a refused stream
   still get an HTTP error status instead of a 200.
2. Each delta carries newly published text and the token ids it came from.
   The engine detokenizes incrementally and applies stop strings itself, with
   stop buffering: text that could still turn into a stop string is held back
   until it cannot, and the stop string itself is never delivered. The
   server passes ``stop`` through untouched.
3. The last delta has ``finish_reason`` set (it may carry text too); the
   iterator ends after it. A failure inside the engine raises
   ``GenerationFailed`` from the iterator; ``QueueTimeout``, a kind of it,
   when the request waited for a slot longer than the engine allows.
4. ``cancel(request_id)`` is how the server reports a client that went away
   (or a stream it stopped reading). It must be cheap, idempotent, safe to
   call after the request finished, and callable from the event loop thread;
   the engine stops selecting the request at once and frees its resources
   after its last submitted frame (spec A6).
5. ``begin_drain(grace_s)`` starts shutdown (``helios.server.serve``); see
   its docstring.
6. ``stats()`` is read by the ``/metrics`` collector on every scrape; it must
   be cheap and thread-safe. Counters in it are cumulative since start.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable


class FinishReason(str, Enum):
    """Why a generation ended, spelled as OpenAI's ``finish_reason``."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the engine ended it early: a shutdown drain ran out of grace


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries (flare_contract.sampling.LOGIT_BIAS_ENTRIES)
MAX_TOP_LOGPROBS = 20  # alternatives per token the programs report (flare_contract.sampling.TOP_LOGPROBS)
MAX_STOP_TOKEN_IDS = 16  # with up to 4 end-of-sequence ids, what min_tokens can suppress (SUPPRESSED_ENTRIES)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling, validated at construction.

    temperature 0 means greedy. ``top_k`` None means no top-k cut; ``seed``
    None means unseeded. A seeded request's token at each absolute position
    must not depend on which programs or cohorts served it (issue 5). The
    controls (vLLM's meanings) run inside the programs' sampling, so they keep
    that guarantee: ``min_p`` (0: none), ``repetition_penalty`` (1: none; over
    prompt and output tokens), ``presence_penalty`` and ``frequency_penalty``
    (0: none; over output tokens), ``logit_bias`` (token id, bias) pairs added
    to the logits (greedy rows too).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None (no cut) or >= 1, got {self.top_k}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (math.isfinite(getattr(self, name)) and -2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if any(not (math.isfinite(b) and -100.0 <= b <= 100.0) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as the engine sees it: token ids, limits, sampling, stops.

    ``request_id`` is chosen by the server and is the id the client sees;
    ``cancel`` uses it. ``endpoints`` are the prompt offsets where chat
    messages end (spec K1 conversation anchors); empty for plain completions.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    endpoints: tuple[int, ...] = ()
    logprobs: int | None = None  # report each output token's logprob and this many alternatives (None: none)
    min_tokens: int = 0  # end-of-sequence and stop_token_ids cannot be produced before this many output tokens
    ignore_eos: bool = False  # the end-of-sequence ids do not end the request
    stop_token_ids: tuple[int, ...] = ()  # further ids that end it (the id is output; its text only with
    include_stop_str_in_output: bool = False  # ... this, which also keeps a matched stop string in the text)
    # Scored prefill (spec C1): report every prompt token's logprob (the first is None) and this many
    # alternatives, on the request's first delta; max_tokens may then be 0 (no output, only the scores)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a generation request needs at least one prompt token")
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be >= 1 (>= 0 with prompt_logprobs), got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        assert all(0 < e <= len(self.prompt_token_ids) for e in self.endpoints), "endpoints lie inside the prompt"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.prompt_logprobs}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")


@dataclass(frozen=True, slots=True)
class Alternative:
    """One of the most likely tokens at an output position."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An output token's log-probability under the model's raw distribution at its position (before
    temperature, penalties, bias and filtering: vLLM's default), and that distribution's best tokens."""

    token_id: int
    logprob: float
    top: tuple[Alternative, ...]  # most likely first; the programs report MAX_TOP_LOGPROBS
    rank: int | None = None  # prompt scores: the token's rank (1: most likely) when among the programs' top


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class TextDelta:
    """Newly published output: text, the token ids it came from, and maybe the end."""

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for logprobs
    # the request's first delta, when it asked for prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    cached_tokens: int = 0  # the request's prompt tokens restored from a checkpoint (usage), on every delta


@dataclass(frozen=True, slots=True)
class ExecutionTotals:
    """Cumulative executions of one (graph kind, selection category) pair (spec D9)."""

    graph_kind: str  # GraphKind value: "decode", "speculative", ...
    category: str  # SelectionReason value: ordinary | discovery | timing_refresh | acceptance_learning
    executions: int
    nanoseconds: int


@dataclass(frozen=True, slots=True)
class SpeculativeTotals:
    """Cumulative counts over complete speculative programs for one proposal source.

    A *round* is one lane of one complete program that offered at least one
    draft for verification; width-one rounds and prompt rows are not counted.
    """

    source: str = "learned"  # "learned" (draft model) or "copy" (prompt lookup)
    rounds: int = 0  # lane rounds that verified drafts
    draft_tokens: int = 0  # draft positions verified (CompletionRecord.offered)
    accepted_tokens: int = 0  # drafts the target accepted
    emitted_tokens: int = 0  # tokens committed: accepted drafts plus bonus tokens
    accepted_by_position: tuple[int, ...] = ()  # [i]: rounds whose draft at position i + 1 was accepted

    def plus(self, offered: int, accepted: int, emitted: int) -> SpeculativeTotals:
        """These totals after one more round."""
        positions = list(self.accepted_by_position)
        positions.extend([0] * (accepted - len(positions)))
        for i in range(accepted):
            positions[i] += 1
        return SpeculativeTotals(self.source, self.rounds + 1, self.draft_tokens + offered,
                                 self.accepted_tokens + accepted, self.emitted_tokens + emitted, tuple(positions))


@dataclass(frozen=True, slots=True)
class CheckpointStats:
    """The checkpoint store (prefix reuse, docs/checkpoints.md): gauges now, counters since start."""

    rows: int = 0  # checkpoint rows the catalog keeps (0: no store, or prefix reuse off)
    held: int = 0  # rows holding a published checkpoint
    bytes_held: int = 0  # their memory
    hits: int = 0  # admissions that restored a checkpoint
    misses: int = 0  # admissions (with a store) that found none
    cached_tokens: int = 0  # prompt tokens restored instead of prefilled
    captures: int = 0  # snapshots published
    evictions: int = 0  # checkpoints given up for a new one (K3)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for ``/metrics`` and ``/health``. Gauges now, counters since start."""

    requests_running: int = 0  # admitted and holding a slot
    requests_waiting: int = 0  # submitted, not yet admitted
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    executions: tuple[ExecutionTotals, ...] = ()
    speculative: tuple[SpeculativeTotals, ...] = ()  # one per proposal source that ran a round
    accepting: bool = True  # False while draining: /health answers 503
    shed_waiting_full: int = 0  # submissions refused because the waiting line was full (EngineOverloaded)
    shed_queue_timeout: int = 0  # requests ended by QueueTimeout before they got a slot
    checkpoints: CheckpointStats = CheckpointStats()


class RequestRejected(Exception):
    """The engine cannot serve this request as asked; the message says why (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineUnavailable(Exception):
    """The engine is not admitting requests now (draining, shutting down): HTTP 503.

    ``retry_after_s``, when set, is how soon a retry may succeed (the ``Retry-After`` header).
    """

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineOverloaded(EngineUnavailable):
    """Too many requests already wait for a slot (``flare run --max-waiting``): HTTP 503 with Retry-After."""


class GenerationFailed(Exception):
    """Raised from a delta iterator when the engine failed this request (e.g. its frame raised)."""


class QueueTimeout(GenerationFailed):
    """The request waited for a slot longer than the engine allows (``flare run --queue-timeout``).

    It never ran, so a retry later is safe: HTTP 503 with Retry-After when nothing was sent yet.
    """

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ChatTemplateError(ValueError):
    """The chat template rejected these messages (e.g. roles out of order): HTTP 400."""


@runtime_checkable
class EngineTokenizer(Protocol):
    """Text <-> token ids for the server; the engine detokenizes its own output.

    A tokenizer may also have ``max_token_bytes``: the most UTF-8 bytes of
    input text that one token id can stand for, or None when no such bound
    holds (e.g. a normalizer that deletes characters). With it the server
    refuses text that cannot fit the context before tokenizing it
    (``fewest_tokens``); it is optional, so tokenizers without it still work.
    """

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; special-token spellings in the text are recognised.

        ``add_special_tokens`` adds the model's own BOS (or similar) where it has
        one: True for raw completion prompts, False for rendered chat templates,
        which already contain them.
        """
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The checkpoint's chat template rendered over ``messages`` (each has role and content), with
        ``template_kwargs`` as further template variables.

        Raises ``ChatTemplateError`` when the template refuses the messages.
        """
        ...


def fewest_tokens(tokenizer: EngineTokenizer, text: str) -> int:
    """A lower bound on ``len(tokenizer.encode(text, ...))`` found without tokenizing (0: no bound known).

    Counting UTF-8 bytes takes about a millisecond per megabyte; tokenizing one takes about a second.
    """
    most = getattr(tokenizer, "max_token_bytes", None)
    if not most:
        return 0
    return -(-len(text.encode("utf-8", "surrogatepass")) // most)


@runtime_checkable
class Engine(Protocol):
    """The runtime as the HTTP server uses it (see the module docstring for the contract)."""

    @property
    def model_name(self) -> str: ...

    @property
    def context_length(self) -> int:
        """Most tokens one request may hold: prompt plus output."""
        ...

    @property
    def tokenizer(self) -> EngineTokenizer: ...

    async def start(self) -> None:
        """Called once from the server's startup, inside its event loop."""
        ...

    def begin_drain(self, grace_s: float) -> None:
        """Shutdown began (called from the event loop): refuse new submissions.

        From now on ``submit`` raises ``EngineUnavailable`` and
        ``stats().accepting`` is False. Running requests may finish for up to
        ``grace_s`` seconds; then each remaining one gets a last delta with
        ``FinishReason.ABORT`` and its resources are freed.
        """
        ...

    async def stop(self) -> None:
        """Called once at server shutdown, after the HTTP side stopped taking requests."""
        ...

    def submit(self, request: GenerationRequest) -> AsyncIterator[TextDelta]: ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
