"""The engine: the loop of DESIGN.md behind ``helios.runtime.engine_api.Engine``.

Three threads (docs/runtime.md):

- the asyncio event loop (the server's) calls ``submit``/``cancel``/``stats``
  and reads each request's delta queue; it never touches the scheduler;
- the *control thread* owns the scheduler, the page allocator and every
  request's state. It sleeps on one event queue (submissions, cancellations,
  finished frames, drain) and after each event runs the loop:
  admit waiting requests -> ``advance_to`` -> ``plan`` -> reserve pages ->
  bind -> ``commit`` -> hand the frame to the worker, until the scheduler
  returns no plan (both frame slots full, or feedback needed);
- the *device worker* runs frames in fence order and posts each result back.

A finished frame is ``complete``d, its tokens detokenized and published, and
each visible publication reported with ``published_output`` before the next
event is taken (spec A4). Decode programs keep their pending tokens in device
state, so the scheduler may commit a second decode frame while the first runs;
the worker simply finds it queued.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from helios.catalog.load import Catalog
from helios.runtime.detokenize import OutputText
from helios.runtime.engine_api import (
    CheckpointStats,
    EngineStats,
    EngineUnavailable,
    ExecutionTotals,
    FinishReason,
    GenerationFailed,
    GenerationRequest,
    QueueTimeout,
    RequestRejected,
    SpeculativeTotals,
    TextDelta,
    TokenLogprob,
)
from flare_contract.sampling import BIAS_FOREVER, SUPPRESSED_ENTRIES
from helios.runtime.executor import (
    BiasEntry,
    BoundFrame,
    Executor,
    FrameResult,
    LaneContext,
    PageTable,
    Program,
    RowInputCache,
    RowSampling,
    bind,
    row_sampling,
    takes_host_drafts,
)
from helios.runtime.checkpoint_store import CheckpointStore
from helios.runtime.pages import PageAllocator, PageLayout
from helios.runtime.state_ops import STATE_KINDS, BoundState, StateResult, StoreShape, bind_state, state_copies
from helios.scheduler import Scheduler
from helios.scheduler.config import SPECULATION_MODES, PolicyConfig
from helios.scheduler.core import RequestView
from helios.scheduler.types import (
    AdmitRequest,
    CompletionRecord,
    ExecutionTiming,
    GeneratedToken,
    LanePhase,
    PlannedLane,
    Fence,
    RequestHandle,
    ScheduledPlan,
)
from helios.text.tokenizer import CheckpointTokenizer
from helios.runtime.waiting import DEFAULT_MAX_WAITING, RETRY_AFTER_S, WaitingLine

log = logging.getLogger(__name__)

EOS_SPELLINGS = ("<|im_end|>", "<|endoftext|>")
LOOKUP_NGRAMS = (3, 2, 1)  # prompt lookup tries the longest suffix first
CANCELLED = object()  # ends a cancelled request's delta iterator without a finish reason
ADAPTIVE_FLOORS = ("plain", "draft")  # EngineConfig.adaptive_floor


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs a catalog; ``flare run`` builds one from its flags."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    speculation: str = "adaptive"  # off: ordinary programs; fixed: one verification width, no probes (D8)
    threads: int | None = None  # torch intra-op threads; None: every core
    device: str = "cpu"
    frame_slots: int = 2  # 1 never queues a frame behind a running one (to measure what overlap buys)
    speculative_width: int | None = None  # adaptive: widest W to load; fixed: the one W (None: the widest)
    # adaptive: what a row runs when it does not draft (``select_programs``). "plain": the ordinary decode and
    # mixed programs stay beside their draft-keeping width-one twins and the scheduler picks by measured value
    # per time; a row that ran a plain frame never drafts again (its draft cache fell behind). "draft": only
    # the twins, so every row can draft at any frame and pays the draft's absorption step on every frame.
    adaptive_floor: str = "plain"
    max_waiting: int = DEFAULT_MAX_WAITING  # requests without a slot beyond which submit refuses (503)
    queue_timeout_s: float | None = None  # longest wait for a slot before QueueTimeout (None: no limit)
    prefix_reuse: bool = True  # restore retained checkpoints and capture new ones, where the catalog has a store
    # the interpreter's GIL switch interval while the engine runs (sys.setswitchinterval; None: leave it): a worker
    # whose compiled call returned waits this long for the GIL before it may take it from a busy Python thread
    switch_interval_s: float | None = 0.0005

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.frame_slots not in (1, 2):
            raise ValueError(f"frame_slots must be 1 or 2 (spec A7), got {self.frame_slots}")
        if self.speculative_width is not None and self.speculative_width < 1:
            raise ValueError(f"speculative_width must be >= 1, got {self.speculative_width}")
        if self.switch_interval_s is not None and not 0.0 < self.switch_interval_s <= 1.0:
            raise ValueError(f"switch_interval_s must be in (0, 1] seconds, got {self.switch_interval_s}")
        if self.adaptive_floor not in ADAPTIVE_FLOORS:
            raise ValueError(f"adaptive_floor must be one of {', '.join(ADAPTIVE_FLOORS)}, got {self.adaptive_floor!r}")


def select_programs(graphs: Sequence[GraphDescriptor], speculation: str,
                    width: int | None = None, floor: str = "plain") -> tuple[GraphDescriptor, ...]:
    """Load-time selection (spec C6, Y3): drop programs, never invent capacities.

    ``off`` (or ``width`` 1: zero drafts, or a catalog without speculative
    programs) keeps the ordinary programs, which never touch the draft model.
    ``adaptive`` keeps every width up to ``width``. Its ``floor`` says what a
    row runs when it does not draft, in a catalog with draft state (learned
    proposals): "draft" drops the ordinary decode and mixed programs for their
    draft-keeping twins (the spec's rule: a frame that skipped draft absorption
    would leave the draft cache behind); "plain" keeps both (a departure,
    docs/scheduling-utility.md "Departures"): the scheduler then chooses by
    measured value per time, and a row that ran an ordinary frame is never
    offered a learned round again (``Scheduler``'s draft tracking).
    ``fixed`` keeps one verification width (``width``, default the widest of
    ``fixed_widths``), host-allocated ragged programs included, drops
    device-allocated (prefix-limit) rounds, which need adaptive selection, and
    replaces ordinary generation by the twins as "draft" does.
    """
    if floor not in ADAPTIVE_FLOORS:
        raise ValueError(f"the adaptive floor must be one of {', '.join(ADAPTIVE_FLOORS)}, got {floor!r}")
    widths = sorted({g.width for g in graphs if g.draws_proposals})
    if width is not None and width > 1 and width not in widths:
        raise ValueError(f"no speculative program of width {width} in the catalog; "
                         f"its widths are {', '.join(map(str, [1, *widths]))} (1 loads the ordinary programs only)")
    if speculation == "off" or width == 1 or not widths:
        return tuple(g for g in graphs if g.proposal_source is None)
    keeps_draft_state = any(g.proposal_source == "learned" for g in graphs)
    if speculation == "adaptive":
        drop_plain = keeps_draft_state and floor == "draft"
        return tuple(g for g in graphs if (width is None or g.width <= width)
                     and not (drop_plain and _ordinary_generation(g)))
    kept = tuple(g for g in graphs if not (keeps_draft_state and _ordinary_generation(g)))
    fixed = _fixed_width(graphs, width)
    return tuple(g for g in kept if _fixed_keeps(g, fixed))


def fixed_widths(graphs: Sequence[GraphDescriptor]) -> list[int]:
    """Verification widths ``fixed`` can run: those of host-allocated speculative programs, ascending."""
    return sorted({g.width for g in graphs if g.draws_proposals and not g.is_prefix_limit})


def _fixed_width(graphs: Sequence[GraphDescriptor], width: int | None) -> int:
    usable = fixed_widths(graphs)
    if width is None and usable:
        return usable[-1]
    if width in usable:
        return width
    listed = ", ".join(map(str, usable)) or "none"
    raise ValueError(f"fixed speculation needs host-allocated programs{'' if width is None else f' of width {width}'}; "
                     f"the catalog's are at widths {listed} (device-allocated prefix-limit rounds need adaptive)")


def _ordinary_generation(graph: GraphDescriptor) -> bool:
    return graph.proposal_source is None and graph.kind in (GraphKind.DECODE, GraphKind.MIXED)


def _fixed_keeps(graph: GraphDescriptor, width: int) -> bool:
    """Fixed width W: prompt programs and width-W rounds, separate and mixed alike (a width-one mixed
    frame without a prompt row would be a width-one decode round)."""
    if graph.value_source is ValueSource.PREFIX_LIMIT:
        return False
    if graph.kind in (GraphKind.SPECULATIVE, GraphKind.MIXED):
        return graph.width == width
    return True


# ---------------------------------------------------------------------------
# One request, as the engine keeps it
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Live:
    """Everything the engine knows about one request (one object; no parallel maps)."""

    request: GenerationRequest
    sampling: RowSampling
    text: OutputText
    deliver: Callable[[TextDelta | Exception], None]
    stop_ids: frozenset[int] | None = None  # ids that end it (ignore_eos, stop_token_ids); None: end-of-sequence
    handle: RequestHandle | None = None
    output: list[int] = field(default_factory=list)  # committed output tokens
    unreported: list[int] = field(default_factory=list)  # token ids not yet carried by a delta
    unreported_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the request asked
    prompt_scores: list[TokenLogprob] = field(default_factory=list)  # scored prompt tokens 1.. so far (C1)
    prompt_reported: bool = False  # the prompt's scores went out (on the first delta)
    done: bool = False  # its last delta (or failure) was delivered
    cached_tokens: int = 0  # prompt tokens restored from a checkpoint (usage's cached_tokens)
    restoring: Any = None  # the checkpoint its restore reads, until that completes (CheckpointStore)

    def history(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output]


def prompt_lookup(history: Sequence[int], count: int) -> tuple[int, ...]:
    """Copy proposals: what followed the latest earlier occurrence of the history's last n-gram.

    Always ``count`` tokens long (repeating the last known token where the
    lookup runs short): verification makes any draft safe, and a full row
    keeps the scheduler's query length exact.
    """
    if count <= 0 or not history:
        return ()
    found: list[int] = []
    for n in LOOKUP_NGRAMS:
        if len(history) <= n:
            continue
        tail = list(history[-n:])
        for start in range(len(history) - n - 1, -1, -1):
            if list(history[start:start + n]) == tail:
                found = list(history[start + n:start + n + count])
                break
        if found:
            break
    filler = found[-1] if found else history[-1]
    return tuple(found + [filler] * (count - len(found)))


# ---------------------------------------------------------------------------
# Control-thread events
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Submitted:
    live: Live


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class _Finished:
    fence: int
    plan: ScheduledPlan
    result: FrameResult | None
    error: BaseException | None
    dispatched_ns: int
    # a program frame's bound inputs, outputs and device interval, read into ``result`` on the control
    # thread (``Executor.finish``); None once read, and for state programs
    called: tuple[BoundFrame, Mapping[str, Any], int, int] | None = None  # and the call's end (A3's wall interval)


@dataclass(frozen=True, slots=True)
class _AbortAll:
    pass


@dataclass(frozen=True, slots=True)
class _Tick:
    """No event came before the oldest waiting request's queue timeout: time to expire it."""


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


@dataclass(slots=True)
class _Counters:
    """Cumulative figures for ``stats()``; written by the control thread under the lock."""

    executions: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    speculative: dict[str, SpeculativeTotals] = field(default_factory=dict)  # by proposal source
    frames: int = 0
    queued_commits: int = 0  # frames committed while another was still in flight
    plans: int = 0  # Scheduler.plan calls (a call that returns None counts too)
    host_ns: int = 0  # control-thread time in plan/commit/complete/publish
    device_ns: int = 0


@dataclass(frozen=True, slots=True)
class EngineState:
    """The engine's scheduling state at one instant, read consistently with the control thread."""

    now_ns: int  # the scheduler's clock
    queued_fences: tuple[Fence, ...]  # submitted frames not yet completed, oldest first
    waiting_requests: int  # requests without a slot (the control thread has seen them)
    requests: tuple[RequestView, ...]  # every request holding a slot (``Scheduler.requests``)
    detail: Any = None  # what ``state_snapshot``'s ``read`` returned, under the same lock


SchedulerFactory = Callable[..., Scheduler]
"""Builds the engine's scheduler: called like ``Scheduler(graphs, request_slots=, policy=, speculation=)``."""


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


class HeliosEngine:
    """Serves one catalog (implements ``helios.runtime.engine_api.Engine``)."""

    def __init__(self, catalog: Catalog, config: EngineConfig = EngineConfig(),
                 program_for: Callable[[str], Program] | None = None,
                 make_scheduler: SchedulerFactory = Scheduler) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)  # intra-op threads of every program call
        self.catalog = catalog
        self.config = config
        self.model_name = str(catalog.manifest.recipe.get("name", catalog.path.name))
        self.tokenizer = CheckpointTokenizer.from_folder(catalog.tokenizer_path)
        self._eos = self._eos_ids()
        layout = catalog.state.layout
        self.pages = PageAllocator(PageLayout(layout["request_slots"], layout["page_size"],
                                              layout["num_pages"], layout["max_pages_per_slot"]))
        self._page_table = PageTable(self.pages.layout)
        self._row_inputs = RowInputCache()
        self.checkpoints = CheckpointStore(catalog.checkpoint_rows if config.prefix_reuse else 0)
        graphs = self._graphs()
        self._max_width = max((g.width for g in graphs), default=1)
        self.context_length = _context_length(catalog, graphs, self.pages.layout)
        self.scheduler = make_scheduler(graphs, request_slots=layout["request_slots"], policy=config.policy,
                                        speculation=config.speculation)
        if config.speculation == "adaptive" and config.adaptive_floor == "plain":
            self.scheduler.track_draft_state()  # ordinary decode stays beside learned rounds (select_programs)
        self._sources = tuple(sorted({g.proposal_source for g in graphs if g.draws_proposals}))
        if torch.device(config.device).type == "cpu":
            catalog.pack_linear_weights()  # before any program binds the weights
        state = catalog.allocate_state(config.device)
        self.executor = Executor(state, program_for or catalog.program, self._eos, config.device)
        self.checkpoints.row_bytes = _checkpoint_row_bytes(state, self.checkpoints.rows)
        self._store_shape = StoreShape.of(state)
        # the two hand-offs every frame crosses twice (control -> worker, worker -> control): the C queue,
        # whose put and blocking get take one lock, where queue.Queue's take a Condition and its Python
        # locks (docs/runtime.md, "Threads")
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: WaitingLine[Live] = WaitingLine(config.max_waiting, config.queue_timeout_s)
        self._by_slot: dict[int, Live] = {}
        self._by_id: dict[str, Live] = {}
        self._fence = 0
        self._running = 0  # frames handed to the device whose completion is not handled yet
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._accepting = True
        self._threads: list[threading.Thread] = []
        self._outbox: _Outbox | None = None  # deliveries to the event loop of the latest submit
        self._due: list[_Outbox] = []  # outboxes holding items the control loop has not woken yet
        self._waker = _Waker()  # does those wake-ups off the control thread (_Waker)
        self._holds_switch_interval = False  # this engine runs with its config's (_SwitchInterval)

    def _eos_ids(self) -> frozenset[int]:
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(self.catalog.tokenizer_path / "tokenizer.json"))
        return frozenset(i for i in (raw.token_to_id(s) for s in EOS_SPELLINGS) if i is not None)

    @property
    def scores_prompts(self) -> bool:
        """Whether prompt logprobs can be served: a scored-prefill program is loaded (spec C1)."""
        return any(g.kind is GraphKind.SCORED_PREFILL for g in self.scheduler.graphs)

    def _graphs(self) -> tuple[GraphDescriptor, ...]:
        """The inference programs the speculation mode keeps, plus the restore and snapshot programs
        when the catalog keeps a checkpoint store and prefix reuse is on (init is never needed here)."""
        graphs = select_programs(self.catalog.descriptors, self.config.speculation, self.config.speculative_width,
                                 self.config.adaptive_floor)
        if not self.checkpoints.enabled:
            return graphs
        state = tuple(g for g in self.catalog.state_descriptors if g.kind in (GraphKind.RESTORE, GraphKind.SNAPSHOT))
        return graphs + state

    def learned_durations(self) -> dict[str, int]:
        """Program id -> the scheduler's current duration estimate (ns), for programs it has measured."""
        with self._lock:
            estimates = self.scheduler.duration_estimates()
        return {graph_id: ns for graph_id, ns in estimates.items() if ns > 0}

    def state_snapshot(self, read: Callable[[], Any] | None = None) -> EngineState:
        """The scheduling state (``/debug/state``), taken while the control thread is between steps.

        ``read``, when given, runs under the same lock and its result is the snapshot's ``detail``:
        anything else the control thread changes (a scheduler's own decision log, say) read consistently.
        """
        with self._lock:
            s = self.scheduler
            return EngineState(s.now_ns, s.queued_fences, len(self._waiting), s.requests(),
                               None if read is None else read())

    # -- lifecycle (event loop) ----------------------------------------------

    async def start(self) -> None:
        self._spawn()

    def _spawn(self) -> None:
        if self._threads:
            return
        if self.config.switch_interval_s is not None:  # given back by shutdown
            _SWITCH_INTERVAL.hold(self.config.switch_interval_s)
            self._holds_switch_interval = True
        self._threads = [threading.Thread(target=self._control_loop, name="helios-control", daemon=True),
                         threading.Thread(target=self._device_loop, name="helios-device", daemon=True),
                         threading.Thread(target=self._waker.run, name="helios-waker", daemon=True)]
        for thread in self._threads:
            thread.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.shutdown)
        log.info("engine stopped after %d frames", self._counters.frames)

    def shutdown(self) -> None:
        """Stop both threads (blocking); requests still running get no further output."""
        if not self._threads:
            return
        self._events.put(_Stop())
        for thread in self._threads:
            thread.join()
        self._threads = []
        if self._holds_switch_interval:
            _SWITCH_INTERVAL.release()
            self._holds_switch_interval = False

    def warm_up(self) -> None:
        """Load every program and call it once with all rows inactive (which mutates nothing)."""
        for graph in self.scheduler.graphs:
            entry = self.catalog.entry(graph.id)
            state = self.executor.state  # persistent state is passed by name; a program may only read some of it
            inputs = {a.name: torch.zeros(a.shape, dtype=getattr(torch, a.dtype))
                      for a in entry.inputs if a.weights is None and not a.mutated and a.name not in state}
            if "prefill_row" in inputs:
                inputs["prefill_row"].fill_(-1)
            program = self.executor.program_for(graph.id)
            program(**{name: t.to(self.executor.device) for name, t in inputs.items()}, **self.executor.state)

    def begin_drain(self, grace_s: float) -> None:
        log.info("draining: no new requests; running ones have %.1f s to finish", grace_s)
        self._accepting = False
        asyncio.get_running_loop().call_later(grace_s, self._events.put, _AbortAll())

    # -- requests (event loop) -------------------------------------------------

    def submit(self, request: GenerationRequest) -> AsyncIterator[TextDelta]:
        if not self._accepting:
            raise EngineUnavailable("the server is shutting down and admits no new requests")
        self._check_fits(request)
        if request.prompt_logprobs is not None and not self.scores_prompts:
            raise RequestRejected("scoring the prompt needs a scored_prefill program, and the loaded catalog has "
                                  "none", "prompt_logprobs")
        self._waiting.reserve(self.scheduler.request_slots - len(self._by_slot))  # EngineOverloaded: a 503
        loop = asyncio.get_running_loop()
        if self._outbox is None or self._outbox.loop is not loop:
            self._outbox = _Outbox(loop, self._due)
        deltas: asyncio.Queue = asyncio.Queue()
        live = Live(request, self._row_sampling(request),
                    OutputText(self.tokenizer, request.stop, request.include_stop_str_in_output),
                    _deliverer(self._outbox, deltas), self._stop_ids(request))
        self._events.put(_Submitted(live))
        return self._relay(request.request_id, deltas)

    def _row_sampling(self, request: GenerationRequest) -> RowSampling:
        """The request's program sampling row: its controls, and ``min_tokens`` as bias entries that
        forbid the ids ending it at output positions below ``prompt + min_tokens``."""
        s = request.sampling
        seed = s.seed if s.seed is not None else random.getrandbits(62)
        bias = [BiasEntry(token_id, value, BIAS_FOREVER) for token_id, value in s.logit_bias]
        if request.min_tokens:
            until = len(request.prompt_token_ids) + request.min_tokens
            ending = sorted(self._eos | set(request.stop_token_ids))
            if len(ending) > SUPPRESSED_ENTRIES:
                raise RequestRejected(f"min_tokens would suppress {len(ending)} ending ids (end-of-sequence and "
                                      f"stop_token_ids); the programs hold {SUPPRESSED_ENTRIES}", "min_tokens")
            bias += [BiasEntry(t, float("-inf"), until) for t in ending]
        return row_sampling(s.temperature, s.top_k, s.top_p, seed, self.tokenizer.vocab_size, min_p=s.min_p,
                            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                            frequency_penalty=s.frequency_penalty, bias=tuple(bias))

    def _stop_ids(self, request: GenerationRequest) -> frozenset[int] | None:
        """The ids that end the request; None: the executor's end-of-sequence ids."""
        if not (request.ignore_eos or request.stop_token_ids):
            return None
        return (frozenset() if request.ignore_eos else self._eos) | frozenset(request.stop_token_ids)

    def _check_fits(self, request: GenerationRequest) -> None:
        prompt = len(request.prompt_token_ids)
        if prompt >= self.context_length:
            raise RequestRejected(f"the prompt has {prompt} tokens but the context holds {self.context_length} "
                                  "including at least one output token", "prompt")
        claim = self.pages.claim_size(self._claimed_positions(request))
        if claim > self.pages.layout.num_pages:
            raise RequestRejected(f"the request needs {claim} KV pages but the cache has "
                                  f"{self.pages.layout.num_pages}; lower max_tokens", "max_tokens")

    def _claimed_positions(self, request: GenerationRequest) -> int:
        """Cache positions a request claims at admission: prompt, every output token it may ask for, and
        the widest round's rows beyond them (a verification round writes K/V past the last kept token)."""
        return len(request.prompt_token_ids) + request.max_tokens + self._max_width

    async def _relay(self, request_id: str, deltas: asyncio.Queue) -> AsyncIterator[TextDelta]:
        finished = False
        try:
            while True:
                item = await deltas.get()
                if item is CANCELLED:
                    finished = True
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        self._events.put(_Cancel(request_id))

    # -- stats (any thread) -----------------------------------------------------

    def stats(self) -> EngineStats:
        with self._lock:
            counters = self._counters
            executions = tuple(ExecutionTotals(kind, reason, n, ns)
                               for (kind, reason), (n, ns) in sorted(counters.executions.items()))
            return EngineStats(
                requests_running=sum(1 for live in self._by_slot.values() if not live.done),
                requests_waiting=self._waiting.waiting(),  # submissions the control thread has not seen yet too
                kv_pages_used=self.pages.used,
                kv_pages_free=self.pages.free,
                executions=executions,
                speculative=tuple(counters.speculative[s] for s in sorted(counters.speculative)),
                accepting=self._accepting,
                shed_waiting_full=self._waiting.refused,
                shed_queue_timeout=self._waiting.timed_out,
                checkpoints=self._checkpoint_stats(),
            )

    def _checkpoint_stats(self) -> CheckpointStats:
        store, c = self.checkpoints, self.checkpoints.counters
        return CheckpointStats(store.rows, len(store.index), store.bytes_held, c.hits, c.misses, c.cached_tokens,
                               c.captures, c.evictions)

    def frame_counters(self) -> _Counters:
        """A copy of the frame counters (tests and benchmarks)."""
        with self._lock:
            return replace(self._counters, executions=dict(self._counters.executions),
                           speculative=dict(self._counters.speculative))

    # -- control thread -----------------------------------------------------

    def _control_loop(self) -> None:
        while True:
            batch = [self._next_event()]
            while not self._events.empty():
                batch.append(self._events.get())
            if any(isinstance(event, _Stop) for event in batch):
                self._drain([event for event in batch if not isinstance(event, _Stop)])
                self._work.put(None)
                self._waker.stop()  # after every wake-up handed to it
                return
            began = time.perf_counter_ns()
            with self._lock:
                try:
                    self._step(batch)
                except Exception as exc:  # a bug here must not leave clients waiting forever
                    self._break_down(exc)
                self._wake_listeners()
                self._counters.host_ns += time.perf_counter_ns() - began

    def _drain(self, events: list) -> None:
        """Stopping: handle the events taken with the stop, then wait for every submitted frame's completion,
        planning nothing new. A completion dropped here would leave its fence queued in the scheduler for
        good, and an engine started again would plan nothing after it (a request that never finishes)."""
        while True:
            with self._lock:
                try:
                    for event in events:
                        if not isinstance(event, _Stop):
                            self._handle(event)
                except Exception as exc:
                    self._break_down(exc)
                self._wake_listeners()
                if self._running == 0:
                    return
            events = [self._events.get()]

    def _wake_listeners(self) -> None:
        """Hand this step's deliveries to their event loops: after the next frame was submitted (_Outbox),
        by the waker thread, so the control thread never waits out the loop's wake-up (_Waker)."""
        for outbox in self._due:
            self._waker.wake(outbox)
        self._due.clear()

    def _next_event(self):
        """The next event, or a ``_Tick`` once the oldest waiting request has waited ``--queue-timeout``."""
        try:
            return self._events.get(timeout=self._waiting.until_expiry(time.monotonic()))
        except queue.Empty:
            return _Tick()

    def _step(self, batch) -> None:
        for event in batch:
            self._handle(event)
        self._expire_waiting()
        self._admit_waiting()
        self._fill_frames()

    def _break_down(self, error: Exception) -> None:
        """The control loop itself failed: stop admitting and fail every request (health turns 503)."""
        log.critical("engine control loop failed; refusing new requests", exc_info=error)
        self._accepting = False
        for live in [*self._waiting, *self._by_slot.values()]:
            if not live.done:
                live.done = True
                live.deliver(GenerationFailed(f"the engine failed: {error}"))
        self._waiting.clear()

    def _handle(self, event) -> None:
        if isinstance(event, _Submitted):
            self._by_id[event.live.request.request_id] = event.live
            self._waiting.append(event.live, time.monotonic())
        elif isinstance(event, _Cancel):
            self._cancel(event.request_id)
        elif isinstance(event, _Finished):
            self._running -= 1
            self._finish_frame(event)
        elif isinstance(event, _AbortAll):
            for live in [*self._waiting, *self._by_slot.values()]:
                self._end(live, TextDelta("", tuple(live.unreported), FinishReason.ABORT))

    def _cancel(self, request_id: str) -> None:
        live = self._by_id.get(request_id)
        if live is None or live.done:
            return
        live.done = True
        live.deliver(CANCELLED)
        self._retire(live)

    def _end(self, live: Live, last: TextDelta | Exception) -> None:
        """Deliver the request's last item and stop scheduling it."""
        if live.done:
            return
        live.done = True
        live.deliver(last)
        self._retire(live)

    def _retire(self, live: Live) -> None:
        """Stop selection now (A6); pages and slot are released after its last frame completes."""
        if live.handle is None:
            self._waiting.remove(live)
            self._by_id.pop(live.request.request_id, None)
            return
        if self.scheduler.is_active(live.handle):
            self.scheduler.cancel(live.handle)
        self._release_if_idle(live)

    def _release_if_idle(self, live: Live) -> None:
        """Free the slot once the request ended, no frame names it and no terminal snapshot holds it (P6)."""
        if (live.done and self.scheduler.inflight(live.handle) == 0 and not self.scheduler.holds(live.handle)
                and self._by_slot.get(live.handle.slot) is live):
            self.checkpoints.released(live.handle, live.restoring)
            live.restoring = None
            del self._by_slot[live.handle.slot]
            self._by_id.pop(live.request.request_id, None)
            self.pages.release(live.handle.slot)
            self._page_table.sync(self.pages, live.handle.slot)

    def _expire_waiting(self) -> None:
        """End the requests that waited longer than ``--queue-timeout`` for a slot; they never ran."""
        for live in self._waiting.expired(time.monotonic()):
            live.done = True
            live.deliver(QueueTimeout(f"the request waited {self._waiting.timeout_s:g} s for a free slot "
                                      f"(flare run --queue-timeout) and never started; retry later", RETRY_AFTER_S))
            self._by_id.pop(live.request.request_id, None)

    def _admit_waiting(self) -> None:
        """FIFO admission while a slot and a page claim are free (waiting, never a crash)."""
        while self._waiting and len(self._by_slot) < self.scheduler.request_slots:
            live = self._waiting[0]
            if self._awaits_capture(live):
                return  # its predecessor's terminal snapshot publishes within a frame (or gives up): then it is admitted
            positions = self._claimed_positions(live.request)
            if not self.pages.can_claim(positions):
                return
            self._waiting.popleft()
            try:
                live.handle = self.scheduler.admit(self._admission(live))
            except Exception as error:  # this request's admission: fail it, keep serving the rest
                log.error("admission of request %s failed", live.request.request_id, exc_info=error)
                self.checkpoints.released(None, live.restoring)
                live.done, live.restoring, live.cached_tokens = True, None, 0
                live.deliver(GenerationFailed(f"the request could not be admitted: {error}"))
                self._by_id.pop(live.request.request_id, None)
                continue
            self.checkpoints.admitted(live.handle, live.restoring)
            self.pages.claim(live.handle.slot, positions)
            self._by_slot[live.handle.slot] = live

    def _awaits_capture(self, live: Live) -> bool:
        """An immediate continuation waits for publication (spec P6): its prompt extends what a finished
        request's pending terminal snapshot captures (prompt and output less the pending last token),
        so admitting it now would miss that checkpoint and prefill it all. The wait ends when the capture
        completes or is given up (``Scheduler.holds`` turns false either way)."""
        if not self.checkpoints.enabled or live.request.prompt_logprobs is not None:
            return False
        prompt = live.request.prompt_token_ids
        for held in self._by_slot.values():
            if held.done and self.scheduler.holds(held.handle):
                captured = held.history()[:-1]
                if (len(captured) < len(prompt) and tuple(prompt[:len(captured)]) == tuple(captured)
                        and self.checkpoints.index.alias(captured) is None):
                    return True
        return False

    def _admission(self, live: Live) -> AdmitRequest:
        request = live.request
        speculate = self.config.speculation != "off"
        # a scored prompt needs every position's score, so it restores nothing (C1)
        reuse, live.restoring = self.checkpoints.admission(request.prompt_token_ids, request.endpoints,
                                                           reuse=request.prompt_logprobs is None)
        live.cached_tokens = reuse.cached_tokens
        return AdmitRequest(
            prompt_tokens=len(request.prompt_token_ids), max_tokens=request.max_tokens,
            context_limit=self.context_length, cached_tokens=reuse.cached_tokens, endpoints=request.endpoints,
            proposal_sources=self._sources if speculate else (), greedy=request.sampling.greedy,
            scored_prompt=request.prompt_logprobs is not None,
            restore_row=reuse.restore_row, snapshot_points=reuse.snapshot_points,
            # a scored prompt without output would capture nothing a follow-up could extend
            terminal_snapshot=reuse.terminal_snapshot and request.prompt_logprobs is None,
        )

    def _fill_frames(self) -> None:
        """Plan and submit until the scheduler says no (both slots full, or feedback needed)."""
        while len(self.scheduler.queued_fences) < self.config.frame_slots:
            try:
                self.scheduler.advance_to(time.monotonic_ns())
                self._counters.plans += 1
                plan = self.scheduler.plan()
            except Exception as error:
                self._planning_failed(error)
                return
            if plan is None:
                return
            self._submit(plan)

    def _planning_failed(self, error: Exception) -> None:
        """Planning raised: no frame to blame, so the requests it was choosing among fail, and the engine
        goes on admitting (their frames in flight still complete and give their pages back)."""
        log.error("planning failed; failing the %d resident requests", len(self._by_slot), exc_info=error)
        for live in list(self._by_slot.values()):
            self._end(live, GenerationFailed(f"the scheduler failed to plan: {error}"))

    def _submit(self, plan: ScheduledPlan) -> None:
        queued_behind = bool(self.scheduler.queued_fences)
        try:
            frame = self._bind(plan)
            self.scheduler.commit(plan, self._fence + 1)  # checks before it changes anything
        except Exception as error:  # this frame's inputs: fail its requests, keep serving the rest
            self._disarm(plan)
            self._fail_frame(plan, error, "preparing")
            return
        self._fence += 1
        self._counters.queued_commits += queued_behind
        self._running += 1
        self._work.put((self._fence, plan, frame, time.monotonic_ns()))

    def _bind(self, plan: ScheduledPlan) -> BoundFrame | BoundState:
        """Reserve the lanes' pages and pack the frame's inputs (nothing is committed yet)."""
        if plan.graph.kind in STATE_KINDS:
            return self._bind_state(plan)
        contexts = {}
        for lane in plan.lanes:
            live = self._by_slot[lane.handle.slot]
            contexts[lane.handle] = self._lane_context(live, lane, plan)
            if self.pages.reserve(lane.handle.slot, self._lane_extent(live, lane, plan)):
                self._page_table.sync(self.pages, lane.handle.slot)
        return bind(plan, contexts, self._page_table.snapshot(), self._row_inputs)

    def _bind_state(self, plan: ScheduledPlan) -> BoundState:
        """A restore reads its request's checkpoint into the slot's own pages (reserved here); a snapshot
        writes a destination row chosen now (K3), armed until its frame completes."""
        destinations = {}
        try:
            for lane in plan.lanes:
                if lane.phase is LanePhase.RESTORE:
                    if self.pages.reserve(lane.handle.slot, lane.checkpoint_tokens):
                        self._page_table.sync(self.pages, lane.handle.slot)
                elif lane.phase is LanePhase.SNAPSHOT:
                    destinations[lane.handle] = self.checkpoints.destination(lane.handle)
            return bind_state(plan.graph, state_copies(plan, destinations), self._page_table.snapshot(),
                              self._store_shape)
        except Exception:
            for row in destinations.values():
                self.checkpoints.abandoned(row)
            raise

    def _lane_context(self, live: Live, lane: PlannedLane, plan: ScheduledPlan) -> LaneContext:
        """A prompt lane's prompt; a copy-source lane's prompt-lookup drafts (learned programs draw their own)."""
        wants = live.request.logprobs is not None
        if lane.phase is LanePhase.PROMPT:
            return LaneContext(live.sampling, prompt=live.request.prompt_token_ids, stop_ids=live.stop_ids,
                               logprobs=wants)
        if not (takes_host_drafts(plan.graph) and plan.graph.draws_proposals):
            return LaneContext(live.sampling, stop_ids=live.stop_ids, logprobs=wants)
        return LaneContext(live.sampling, drafts=prompt_lookup(live.history(), lane.query_length - 1),
                           stop_ids=live.stop_ids, logprobs=wants)

    def _lane_extent(self, live: Live, lane: PlannedLane, plan: ScheduledPlan) -> int:
        """Cache positions the lane may write through this frame (S3, A11, A13).

        A prompt lane writes its chunk. A decode lane starts after everything
        committed and everything earlier queued frames may still commit, and
        writes target K/V for its rows (at most its ceiling or query length)
        and draft K/V for D proposal steps plus its pending token.
        """
        if lane.phase is LanePhase.PROMPT:
            return lane.prompt_start + lane.prompt_tokens
        written = len(live.request.prompt_token_ids) + len(live.output) + self.scheduler.queued_output(live.handle)
        return written + max(lane.query_length, lane.ceiling, plan.graph.proposal_depth + 1)

    # -- completion and publication (control thread) ---------------------------

    def _finish_frame(self, event: _Finished) -> None:
        plan = event.plan
        if event.called is not None:
            frame, *called = event.called
            try:
                result, error = self.executor.finish(frame, *called, event.dispatched_ns), None
            except Exception as exc:  # a broken program contract fails this frame's requests only
                result, error = None, exc
            event = _Finished(event.fence, plan, result, error, event.dispatched_ns)
        self.scheduler.advance_to(time.monotonic_ns())
        if event.error is not None:
            records, timing = (), _unmeasured(event.dispatched_ns)
            self._fail_frame(plan, event.error, "running")
        elif isinstance(event.result, StateResult):
            records, timing = tuple(CompletionRecord(lane.handle) for lane in plan.lanes), event.result.timing
        else:
            records, timing = event.result.records, event.result.timing
        if plan.graph.kind in STATE_KINDS:
            self._settle_state(plan, event.result if event.error is None else None)
        try:
            generated = self._complete(event.fence, plan, records, timing)
        except Exception as error:  # e.g. records the scheduler refuses: this frame's requests fail, no others
            self._fail_frame(plan, error, "completing")
            records, timing = (), _unmeasured(event.dispatched_ns)
            generated = self._retire_fence(event.fence, plan, timing)
        self._count(plan, records, timing)
        logprobs = getattr(event.result, "logprobs", None) or {}
        self._gather_prompt_scores(event)
        for token in generated:
            self._publish_or_fail(self._by_slot[token.handle.slot], token, logprobs.get(token.handle, ()))
        for lane in plan.lanes:
            live = self._by_slot.get(lane.handle.slot)
            if live is not None and live.handle == lane.handle:
                self._release_if_idle(live)

    def _gather_prompt_scores(self, event: _Finished) -> None:
        """A scored prefill's chunk scores, kept on its request until its first delta (chunks complete in order)."""
        scores = getattr(event.result, "prompt_logprobs", None) or {}
        for handle, chunk in scores.items():
            live = self._by_slot.get(handle.slot)
            if live is not None and live.handle == handle and live.request.prompt_logprobs is not None:
                live.prompt_scores.extend(chunk)

    def _disarm(self, plan: ScheduledPlan) -> None:
        for lane in plan.lanes:
            if lane.phase is LanePhase.SNAPSHOT:
                self.checkpoints.disarm(lane.handle)

    def _settle_state(self, plan: ScheduledPlan, result: StateResult | None) -> None:
        """After a state frame: restores release their source rows; a snapshot that copied publishes its
        tokens (cache publication before the slot frees, P6), one that did not gives its row back."""
        if result is None:
            self._disarm(plan)
        copied = dict(zip((c.slot for c in result.copies), result.copied)) if result is not None else {}
        rows = {c.slot: c.row for c in result.copies} if result is not None else {}
        for lane in plan.lanes:
            live = self._by_slot.get(lane.handle.slot)
            if lane.phase is LanePhase.RESTORE:
                self.checkpoints.restored(lane.handle)
                if live is not None and live.handle == lane.handle:
                    live.restoring = None
                continue
            row = rows.get(lane.handle.slot, -1)
            if row < 0:
                continue
            if live is None or live.handle != lane.handle or copied.get(lane.handle.slot, 0) != lane.checkpoint_tokens:
                self.checkpoints.abandoned(row)
                continue
            self.checkpoints.captured(row, live.history()[: lane.checkpoint_tokens],
                                      len(live.request.prompt_token_ids), live.request.endpoints)

    def _complete(self, fence: int, plan: ScheduledPlan, records, timing: ExecutionTiming) -> list[GeneratedToken]:
        """The completion call the program's value source and sidecars ask for (spec "Planning and the execution queue")."""
        confidence = _sidecar(records, "confidence")
        survival = _sidecar(records, "survival")
        if plan.graph.is_prefix_limit:
            if survival is None:
                return self.scheduler.complete_packed_round(fence, records, timing, confidence)
            return self.scheduler.complete_packed_round_with_survival(fence, records, timing, confidence, survival)
        if survival is None:
            return self.scheduler.complete(fence, records, timing)
        return self.scheduler.complete_with_survival(fence, records, timing, survival)

    def _retire_fence(self, fence: int, plan: ScheduledPlan, timing: ExecutionTiming) -> list[GeneratedToken]:
        """Complete a failed frame with no records (its lanes are cancelled), unless the scheduler already did."""
        if fence not in self.scheduler.queued_fences:
            return []
        return self._complete(fence, plan, (), timing)

    def _fail_frame(self, plan: ScheduledPlan, error: BaseException, stage: str) -> None:
        """Preparing, running or completing a frame raised: fail that frame's requests only (spec: one
        program's exception fails only its frame); their pages free once no queued frame names them."""
        log.error("%s a frame of %s failed; failing the %d requests of the frame", stage, plan.graph.id,
                  len(plan.lanes), exc_info=error)
        message = f"{stage} a frame of {plan.graph.id} failed: {error}"
        for lane in plan.lanes:
            live = self._by_slot.get(lane.handle.slot)
            if live is not None and live.handle == lane.handle:
                if live.done and self.scheduler.holds(live.handle):
                    self.scheduler.cancel(live.handle)  # its terminal snapshot failed: give the capture up (P6)
                    self._release_if_idle(live)  # it ended before: _end below releases nothing
                self._end(live, GenerationFailed(message))

    def _publish_or_fail(self, live: Live, token: GeneratedToken, logprobs: Sequence[TokenLogprob] = ()) -> None:
        """Publish one request's tokens; if that raises (detokenizing, say), only this request fails."""
        try:
            self._publish(live, token, logprobs)
        except Exception as error:
            log.error("publishing output of request %s failed", live.request.request_id, exc_info=error)
            self._end(live, GenerationFailed(f"publishing the output failed: {error}"))

    def _publish(self, live: Live, token: GeneratedToken, logprobs: Sequence[TokenLogprob] = ()) -> None:
        """Detokenize, apply stops, deliver, and report visible output (A4) before the next completion.

        A stop_token_ids id that ended the request is output as a token; its text is
        dropped unless ``include_stop_str_in_output`` (vLLM's behaviour).
        """
        if live.done:
            return
        live.output.extend(token.tokens)
        live.unreported.extend(token.tokens)
        if live.request.logprobs is not None:
            live.unreported_logprobs.extend(_trimmed(logprobs[: len(token.tokens)], live.request.logprobs))
        released = live.text.add(self._text_tokens(live, token))
        text, reason = released.text, FinishReason.STOP if released.stopped else None
        if reason is None and token.finished:
            tail = live.text.finish()
            text += tail.text
            reason = FinishReason.STOP if tail.stopped or token.finish_reason == "stop" else FinishReason.LENGTH
        if not text and reason is None:
            return  # held back: no visible output yet, so no delivery is reported
        delta = TextDelta(text, tuple(live.unreported), reason, tuple(live.unreported_logprobs),
                          self._prompt_report(live), cached_tokens=live.cached_tokens)
        live.unreported.clear()
        live.unreported_logprobs.clear()
        if text:
            self.scheduler.published_output(live.handle, token.fence)
        if reason is None:
            live.deliver(delta)
        else:
            self._end(live, delta)

    def _prompt_report(self, live: Live) -> tuple[TokenLogprob | None, ...]:
        """Every prompt token's score for the request's first delta (None for the first token); then nothing."""
        top = live.request.prompt_logprobs
        if top is None or live.prompt_reported:
            return ()
        live.prompt_reported = True
        expected = len(live.request.prompt_token_ids) - 1
        if len(live.prompt_scores) != expected:
            raise RuntimeError(f"the scored prefill scored {len(live.prompt_scores)} prompt tokens of {expected}")
        return (None, *(replace(lp, top=lp.top[:top], rank=_rank(lp)) for lp in live.prompt_scores))

    def _text_tokens(self, live: Live, token: GeneratedToken) -> tuple[int, ...]:
        """The tokens whose text is output: all but a final stop_token_ids id, unless asked."""
        request = live.request
        last = token.tokens[-1] if token.tokens else None
        if (token.finished and last in request.stop_token_ids and last not in self._eos
                and not request.include_stop_str_in_output):
            return token.tokens[:-1]
        return token.tokens

    def _count(self, plan: ScheduledPlan, records, timing: ExecutionTiming) -> None:
        c = self._counters
        totals = c.executions.setdefault((plan.graph.kind.value, plan.reason.value), [0, 0])
        totals[0] += 1
        totals[1] += timing.device_ns
        c.frames += 1
        c.device_ns += timing.device_ns
        if not plan.graph.draws_proposals:
            return
        source = plan.graph.proposal_source or "learned"
        for r in records:
            if r.offered > 0:
                totals = c.speculative.get(source) or SpeculativeTotals(source)
                c.speculative[source] = totals.plus(r.offered, min(r.offered, len(r.tokens) - 1), len(r.tokens))

    # -- device worker -------------------------------------------------------------

    def _device_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            fence, plan, frame, dispatched_ns = item
            # A program frame's outputs are read on the control thread (Executor.finish): Python run here, on
            # the core the program just swept through its caches, ran 5-10x slower, and the next queued
            # frame waited for it (docs/runtime.md, "Threads").
            result = error = called = None
            try:
                if isinstance(frame, BoundState):
                    result = self.executor.run_state(frame, dispatched_ns)
                else:
                    called = (frame, *self.executor.call(frame))
            except Exception as exc:  # one program's failure must not stop the server
                error = exc
            self._events.put(_Finished(fence, plan, result, error, dispatched_ns, called))


def _context_length(catalog: Catalog, graphs: Sequence[GraphDescriptor], layout: PageLayout) -> int:
    """Prompt plus output tokens per request: the recipe's context, within what a slot's pages hold.

    A prefix-limit row runs all D draft steps whatever its ceiling, writing
    draft K/V up to L + D - 1 for a cache length L below the context, so those
    programs leave D positions of the slot free (program contract, "Learned
    proposals").
    """
    headroom = max((g.proposal_depth for g in graphs if g.is_prefix_limit), default=0)
    return min(int(catalog.envelope.extra.get("context_length", 1 << 30)), layout.slot_capacity - headroom)


def _checkpoint_row_bytes(state, rows: int) -> int:
    """Bytes one checkpoint row holds: every ``checkpoint_*`` state tensor's share."""
    if rows <= 0:
        return 0
    return sum(t.numel() * t.element_size() for name, t in state.items() if name.startswith("checkpoint_")) // rows


def _trimmed(logprobs: Sequence[TokenLogprob], top: int) -> list[TokenLogprob]:
    """Each token's logprob with the request's number of alternatives."""
    return [replace(lp, top=lp.top[:top]) for lp in logprobs]


def _rank(score: TokenLogprob) -> int | None:
    """A scored token's rank among the programs' best alternatives (None: beyond them)."""
    return next((i + 1 for i, a in enumerate(score.top) if a.token_id == score.token_id), None)


def _unmeasured(dispatched_ns: int) -> ExecutionTiming:
    """A failed frame's timing: no device interval (no cost sample, no service), only its wall time."""
    return ExecutionTiming(0, max(0, time.monotonic_ns() - dispatched_ns))


def _sidecar(records, name: str) -> list | None:
    """One row per record (None where a record has none), or None when no record carries this sidecar."""
    rows = [getattr(r, name) for r in records]
    return rows if any(row is not None for row in rows) else None


class _Outbox:
    """Items for request queues on one event loop, handed over with one wake-up per control step.

    Waking the loop (``call_soon_threadsafe``) is a socket write, after which
    the control thread waits for the GIL while the loop runs: measured at
    batch 1 (benchmarks/host_loop.py), the largest host cost of a frame. So
    ``put`` (control thread) only queues the item and notes the outbox in
    ``due``; once its step has planned and submitted the next frame the
    control loop hands the outbox to the waker thread, which calls ``wake``
    (``_Waker``), so the loop's turn (and the HTTP writes it does) overlaps
    that frame's program instead of delaying its start. The loop drains every
    item put before it ran, in order.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, due: list[_Outbox]) -> None:
        self.loop = loop
        self._due = due  # the engine's outboxes with items and no wake-up yet (control thread only)
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, TextDelta | Exception]] = []

    def put(self, deltas: asyncio.Queue, item: TextDelta | Exception) -> None:
        with self._lock:
            self._items.append((deltas, item))
            if len(self._items) > 1:
                return  # a wake-up is due or on its way and will drain this item too
        self._due.append(self)

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass  # the loop closed: nobody is listening any more

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for deltas, item in items:
            deltas.put_nowait(item)


class _SwitchInterval:
    """The interpreter's GIL switch interval while engines run (``EngineConfig.switch_interval_s``).

    It is one value per process, so engines running at once share it: the first
    to start saves the interpreter's, each start sets its own, and the last to
    stop restores the saved one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved = 0.0

    def hold(self, seconds: float) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved = sys.getswitchinterval()
            self._holders += 1
            sys.setswitchinterval(seconds)

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                sys.setswitchinterval(self._saved)


_SWITCH_INTERVAL = _SwitchInterval()


class _Waker:
    """A thread that wakes event loops (``_Outbox.wake``) for the control thread.

    ``call_soon_threadsafe`` writes to the loop's self-pipe; the loop wakes and
    asks for the GIL, and the writing thread then waits to get it back. Done by
    the control thread, that wait (about 1 ms per frame at batch 1 on two
    cores, benchmarks/host_loop.py's ``wake`` line) sat between finishing one
    frame and planning the next. Handing the outbox to this thread is a lock
    release: the control thread runs on, and the waker writes once the control
    thread next blocks (waiting for its next event) or after the interpreter's
    switch interval. Outboxes are woken in the order handed over.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def wake(self, outbox: _Outbox) -> None:
        self._queue.put(outbox)

    def stop(self) -> None:
        self._queue.put(None)

    def run(self) -> None:
        while (outbox := self._queue.get()) is not None:
            outbox.wake()


def _deliverer(outbox: _Outbox, deltas: asyncio.Queue) -> Callable[[TextDelta | Exception], None]:
    """Hands an item to the request's queue on its event loop (from the control thread)."""
    def deliver(item: TextDelta | Exception) -> None:
        outbox.put(deltas, item)
    return deliver
