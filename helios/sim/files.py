"""The two YAML inputs of ``flare simulate``: a synthetic catalog and a trace.

A synthetic catalog lists graph descriptors (the fields of a real catalog) with
the duration each one takes on the simulated device. A trace lists requests
with their arrival, prompt, output limit and an acceptance model for
speculative rounds, plus the policy and the random seed. Both load into frozen
dataclasses; anything malformed raises ``SimulationFileError`` with one line
that names the file, the entry, the field and what would be accepted.
``docs/simulation.md`` documents both formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import yaml

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from helios.scheduler.config import POLICY_PRESETS, SPECULATION_MODES, PolicyConfig
from helios.scheduler.select.population import MAX_REQUEST_SLOTS

SIMULATED_KINDS = (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.DECODE, GraphKind.SPECULATIVE,
                   GraphKind.MIXED, GraphKind.RESTORE, GraphKind.SNAPSHOT)  # state programs: issue 21, docs/simulation.md
PROPOSAL_SOURCES = ("learned", "copy")


class SimulationFileError(ValueError):
    """A synthetic catalog or trace that cannot be simulated; the message is one line."""


# ---------------------------------------------------------------------------
# The loaded forms
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyntheticGraph:
    """One prepared program and how long the simulated device takes to run it."""

    descriptor: GraphDescriptor
    duration_ns: int
    jitter_ns: int = 0  # each execution draws uniformly within +-jitter


@dataclass(frozen=True, slots=True)
class SyntheticCatalog:
    graphs: tuple[SyntheticGraph, ...]
    request_slots: int

    def descriptors(self) -> tuple[GraphDescriptor, ...]:
        return tuple(graph.descriptor for graph in self.graphs)


@dataclass(frozen=True, slots=True)
class FixedAcceptance:
    """Every speculative round accepts this many drafts (capped by what was offered)."""

    accepted_drafts: int


@dataclass(frozen=True, slots=True)
class SampledAcceptance:
    """survival[d-1] is the probability that the first d drafts all survive.

    The values are nonincreasing; positions past the list never survive. One
    uniform draw per round decides the accepted prefix, which makes the
    per-position decisions consistent with the cumulative probabilities.
    """

    survival: tuple[float, ...]


AcceptanceModel = FixedAcceptance | SampledAcceptance


@dataclass(frozen=True, slots=True)
class AcceptanceChange:
    """From the moment the request has ``after_tokens`` output tokens, rounds follow ``model``."""

    after_tokens: int
    model: AcceptanceModel


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: str
    arrival_ns: int
    prompt_tokens: int
    max_tokens: int
    acceptance: AcceptanceModel = FixedAcceptance(0)
    preseed_acceptance: bool = False  # start as if 64 rounds had been observed
    follows: str | None = None  # conversation: this turn extends that earlier request's prompt and output
    think_ms: float = 0.0  # with ``follows``: arrives this long after the earlier turn finishes
    proposal_source: str = "learned"
    acceptance_schedule: tuple[AcceptanceChange, ...] = ()  # mid-stream changes, increasing after_tokens
    scored_prompt: bool = False  # its prompt runs only in scored-prefill programs (spec C1; echo with logprobs)

    def acceptance_after(self, produced: int) -> AcceptanceModel:
        """The acceptance model in force once ``produced`` output tokens exist."""
        model = self.acceptance
        for change in self.acceptance_schedule:
            if change.after_tokens <= produced:
                model = change.model
        return model


@dataclass(frozen=True, slots=True)
class Trace:
    policy: PolicyConfig
    seed: int
    requests: tuple[TraceRequest, ...]
    speculation: str = "adaptive"  # "fixed": the scheduler never probes acceptance (D8)
    reuse: bool = True  # conversations restore retained checkpoints (False: every turn prefills in full)
    checkpoint_rows: int = 8  # checkpoint rows the simulated engine retains (K3 evicts beyond them)
    # adaptive only, as ``flare run --adaptive-floor``: "plain" keeps ordinary decode and mixed programs beside
    # learned rounds and the scheduler tracks whose draft fell behind; "draft" drops them where learned
    # programs are present; None: the catalog's programs as given, every one taken as draft-keeping
    adaptive_floor: str | None = None


# ---------------------------------------------------------------------------
# Field reading: one small reader per YAML mapping, so every error names its place
# ---------------------------------------------------------------------------


class _Entry:
    """Reads the fields of one YAML mapping and remembers which ones were used."""

    def __init__(self, source: str, where: str, data: Any):
        self.source = source
        self.where = where
        if not isinstance(data, dict):
            self.fail(None, f"expected a mapping of fields, got {_describe(data)}")
        self.data: dict = data
        self.used: set[str] = set()

    def fail(self, name: str | None, problem: str) -> None:
        field = f": field '{name}'" if name else ""
        raise SimulationFileError(f"{self.source}: {self.where}{field}: {problem}")

    def raw(self, name: str, default: Any = ...) -> Any:
        self.used.add(name)
        if name in self.data and self.data[name] is not None:
            return self.data[name]
        if default is ...:
            self.fail(name, "is required")
        return default

    def integer(self, name: str, default: Any = ..., minimum: int = 0) -> int:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(name, f"expected an integer >= {minimum}, got {_describe(value)}")
        if value < minimum:
            self.fail(name, f"expected an integer >= {minimum}, got {value}")
        return value

    def number(self, name: str, default: Any = ..., minimum: float = 0.0, positive: bool = False) -> float:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        wanted = "a finite number > 0" if positive else f"a finite number >= {minimum:g}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(name, f"expected {wanted}, got {_describe(value)}")
        if value < minimum or (positive and value <= 0):
            self.fail(name, f"expected {wanted}, got {value}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            self.fail(name, f"expected true or false, got {_describe(value)}")
        return value

    def text(self, name: str, default: Any = ...) -> str:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            self.fail(name, f"expected a string, got {_describe(value)}")
        return str(value)

    def choice(self, name: str, allowed: tuple[str, ...], default: Any = ...) -> str:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if value not in allowed:
            self.fail(name, f"got {_describe(value)}; allowed: {', '.join(allowed)}")
        return value

    def finish(self, allowed: tuple[str, ...]) -> None:
        """Unknown fields are errors: a typo must not silently fall back to a default."""
        unknown = sorted(str(key) for key in self.data if key not in allowed)
        if unknown:
            self.fail(unknown[0], f"unknown field; allowed fields: {', '.join(allowed)}")


def _describe(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__}"
    return repr(value)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SimulationFileError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "somewhere"
        raise SimulationFileError(f"{path}: not valid YAML ({where}: {getattr(exc, 'problem', exc)})") from None


def _entries(top: _Entry, name: str, describe: Callable[[int, Any], str]) -> list[_Entry]:
    items = top.raw(name)
    if not isinstance(items, list) or not items:
        top.fail(name, f"expected a non-empty list, got {_describe(items)}")
    return [_Entry(top.source, describe(index, item), item) for index, item in enumerate(items)]


def _entry_name(listing: str, index: int, item: Any) -> str:
    if isinstance(item, dict) and item.get("id") is not None:
        return f"{listing}[{index}] (id {item['id']!r})"
    return f"{listing}[{index}]"


# ---------------------------------------------------------------------------
# Synthetic catalog
# ---------------------------------------------------------------------------

GRAPH_FIELDS = (
    "id", "kind", "batch_capacity", "prefill_capacity", "proposal_depth", "width", "aggregate",
    "value_source", "ragged", "proposal_source", "speculation_enabled", "duration_ms", "jitter_ms",
)
CATALOG_FIELDS = ("graphs", "request_slots")


def load_catalog(path: str | Path) -> SyntheticCatalog:
    path = Path(path)
    return parse_catalog(_read_yaml(path), str(path))


def parse_catalog(data: Any, source: str = "<catalog>") -> SyntheticCatalog:
    top = _Entry(source, "top level", data)
    graphs = tuple(_parse_graph(entry) for entry in _entries(top, "graphs", lambda i, g: _entry_name("graphs", i, g)))
    _check_unique_ids(top, graphs)
    widest = max(graph.descriptor.batch_capacity for graph in graphs)
    slots = top.integer("request_slots", min(widest, MAX_REQUEST_SLOTS), minimum=1)
    if slots > MAX_REQUEST_SLOTS:
        top.fail("request_slots", f"expected an integer from 1 to {MAX_REQUEST_SLOTS} (spec U11), got {slots}")
    top.finish(CATALOG_FIELDS)
    return SyntheticCatalog(graphs=graphs, request_slots=slots)


def _parse_graph(entry: _Entry) -> SyntheticGraph:
    kind = GraphKind(entry.choice("kind", tuple(k.value for k in SIMULATED_KINDS)))
    shape = _graph_shape(entry, kind)
    duration_ms = entry.number("duration_ms", positive=True)
    jitter_ms = entry.number("jitter_ms", 0.0)
    if jitter_ms >= duration_ms:
        entry.fail("jitter_ms", f"expected less than duration_ms ({duration_ms:g}), got {jitter_ms:g}")
    graph_id = entry.text("id", None) or _readable_id(kind, shape)
    entry.finish(GRAPH_FIELDS)
    # Device-allocated rounds produce the confidence sidecar they allocate by (spec C12).
    limit = shape["value_source"] is ValueSource.PREFIX_LIMIT
    confidence_width = shape["proposal_depth"] if limit else 0
    try:
        descriptor = GraphDescriptor(id=graph_id, kind=kind, confidence_width=confidence_width, **shape)
    except ValueError as exc:
        entry.fail(None, str(exc))
    return SyntheticGraph(descriptor, _ms_to_ns(duration_ms), _ms_to_ns(jitter_ms))


def _graph_shape(entry: _Entry, kind: GraphKind) -> dict[str, Any]:
    """The descriptor's capacities, with the defaults each kind implies."""
    has_prompt = kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.MIXED)
    has_width = kind in (GraphKind.SPECULATIVE, GraphKind.MIXED)
    _reject_unless(entry, "prefill_capacity", 0, has_prompt, f"{kind.value} graphs take no prompt tokens (prefill, scored_prefill and mixed do)")
    _reject_unless(entry, "width", 1, has_width, f"{kind.value} graphs have width 1 (use kind speculative for wider rounds)")
    width = entry.integer("width", 1, minimum=1) if has_width else 1
    return {
        "batch_capacity": entry.integer("batch_capacity", minimum=1),
        "prefill_capacity": entry.integer("prefill_capacity", minimum=1) if has_prompt else 0,
        "width": width,
        "proposal_depth": entry.integer("proposal_depth", width - 1),
        "aggregate": entry.integer("aggregate", 0),
        "ragged": entry.boolean("ragged", False),
        "value_source": _value_source(entry, width),
        "proposal_source": _proposal_source(entry, kind, width),
        "speculation_enabled": entry.boolean("speculation_enabled", False),
    }


def _reject_unless(entry: _Entry, name: str, neutral: int, allowed: bool, reason: str) -> None:
    """A field that does not apply to this kind may be absent or neutral, never meaningful."""
    value = entry.data.get(name)
    if not allowed and value not in (None, neutral):
        entry.fail(name, f"got {_describe(value)}, but {reason}")
    if not allowed:
        entry.used.add(name)


def _value_source(entry: _Entry, width: int) -> ValueSource | None:
    default = ValueSource.QUERY_LENGTH.value if width > 1 else None
    name = entry.choice("value_source", tuple(v.value for v in ValueSource), default)
    return ValueSource(name) if name is not None else None


def _proposal_source(entry: _Entry, kind: GraphKind, width: int) -> str | None:
    speculative = width > 1 or kind is GraphKind.SPECULATIVE
    return entry.choice("proposal_source", PROPOSAL_SOURCES, "learned" if speculative else None)


def _readable_id(kind: GraphKind, shape: dict[str, Any]) -> str:
    parts = [kind.value, f"b{shape['batch_capacity']}"]
    if shape["prefill_capacity"]:
        parts.append(f"t{shape['prefill_capacity']}")
    if shape["width"] > 1 or kind is GraphKind.SPECULATIVE:
        parts += [f"d{shape['proposal_depth']}", f"w{shape['width']}"]
        if shape["ragged"]:
            parts.append(f"p{shape['aggregate']}")
        if shape["value_source"] is ValueSource.PREFIX_LIMIT:
            parts.append("limit")
    if shape["speculation_enabled"]:
        parts.append("spec")
    return "-".join(parts)


def _check_unique_ids(top: _Entry, graphs: tuple[SyntheticGraph, ...]) -> None:
    seen: set[str] = set()
    for index, graph in enumerate(graphs):
        graph_id = graph.descriptor.id
        if graph_id in seen:
            raise SimulationFileError(
                f"{top.source}: graphs[{index}]: field 'id': {graph_id!r} is used twice; "
                "give each graph a distinct id (or omit ids to generate them)"
            )
        seen.add(graph_id)


def _ms_to_ns(ms: float) -> int:
    return int(round(ms * 1_000_000))


# ---------------------------------------------------------------------------
# Trace
# ---------------------------------------------------------------------------

REQUEST_FIELDS = (
    "id", "arrival_ms", "prompt_tokens", "max_tokens", "accepted_drafts", "acceptance",
    "preseed_acceptance", "proposal_source", "acceptance_schedule", "follows", "think_ms", "scored_prompt",
)
TRACE_FIELDS = ("policy", "seed", "requests", "speculation", "reuse", "checkpoint_rows", "adaptive_floor")
ADAPTIVE_FLOORS = ("plain", "draft")  # helios.runtime.engine.ADAPTIVE_FLOORS (this module imports no torch)
CHANGE_FIELDS = ("after_tokens", "accepted_drafts", "acceptance")
POLICY_FIELDS = ("preset",) + tuple(f.name for f in fields(PolicyConfig))


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    return parse_trace(_read_yaml(path), str(path))


def parse_trace(data: Any, source: str = "<trace>") -> Trace:
    top = _Entry(source, "top level", data)
    policy = _parse_policy(_Entry(source, "policy", top.raw("policy", {})))
    seed = top.integer("seed", 0)
    speculation = top.choice("speculation", SPECULATION_MODES, "adaptive")
    entries = _entries(top, "requests", lambda i, r: _entry_name("requests", i, r))
    requests = tuple(_parse_request(entry, index) for index, entry in enumerate(entries))
    _check_unique_request_ids(top, requests)
    _check_conversations(top, requests)
    reuse = top.boolean("reuse", True)
    rows = top.integer("checkpoint_rows", 8, minimum=1)
    floor = top.choice("adaptive_floor", ADAPTIVE_FLOORS, None)
    if floor is not None and speculation != "adaptive":
        top.fail("adaptive_floor", f"applies to speculation adaptive only, not {speculation}")
    top.finish(TRACE_FIELDS)
    return Trace(policy=policy, seed=seed, requests=requests, speculation=speculation, reuse=reuse,
                 checkpoint_rows=rows, adaptive_floor=floor)


def _check_conversations(top: _Entry, requests: tuple[TraceRequest, ...]) -> None:
    """A follow-up names an earlier request of the list, and takes no arrival time of its own."""
    seen: set[str] = set()
    for request in requests:
        if request.follows is not None and request.follows not in seen:
            top.fail("requests", f"request {request.id!r} follows {request.follows!r}, which is not an earlier request")
        seen.add(request.id)


# PolicyConfig fields nothing reads (none now: terminal snapshots run, spec P6, issue 21).
INERT_POLICY_FIELDS: tuple[str, ...] = ()


def _parse_policy(entry: _Entry) -> PolicyConfig:
    preset = entry.choice("preset", POLICY_PRESETS, "balanced")
    for name in INERT_POLICY_FIELDS:
        if entry.raw(name, None) is not None:
            entry.fail(name, "prices terminal snapshots, which the scheduler does not run yet (spec P6), so it "
                             "would change nothing; leave it out")
    overrides = {}
    for f in fields(PolicyConfig):
        if f.name in INERT_POLICY_FIELDS:
            continue
        read = entry.integer if f.type == "int" else entry.number
        value = read(f.name, None)
        if value is not None:
            overrides[f.name] = value
    entry.finish(POLICY_FIELDS)
    try:
        return PolicyConfig(**{**_as_dict(PolicyConfig.preset(preset)), **overrides})
    except ValueError as exc:
        entry.fail(None, str(exc))


def _as_dict(config: PolicyConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in fields(config)}


def _parse_request(entry: _Entry, index: int) -> TraceRequest:
    request = TraceRequest(
        id=entry.text("id", f"r{index}"),
        arrival_ns=_ms_to_ns(entry.number("arrival_ms", 0.0)),
        prompt_tokens=entry.integer("prompt_tokens", minimum=1),
        max_tokens=entry.integer("max_tokens", minimum=1),
        acceptance=_parse_acceptance(entry),
        preseed_acceptance=entry.boolean("preseed_acceptance", False),
        proposal_source=entry.choice("proposal_source", PROPOSAL_SOURCES, "learned"),
        acceptance_schedule=_parse_schedule(entry),
        follows=entry.text("follows", None),
        think_ms=entry.number("think_ms", 0.0),
        scored_prompt=entry.boolean("scored_prompt", False),
    )
    if request.follows is None and "think_ms" in entry.data:
        entry.fail("think_ms", "only a follow-up turn (follows) waits after an earlier turn")
    if request.follows is not None and "arrival_ms" in entry.data:
        entry.fail("arrival_ms", "a follow-up turn arrives think_ms after the turn it follows finishes")
    entry.finish(REQUEST_FIELDS)
    return request


def _parse_schedule(entry: _Entry) -> tuple[AcceptanceChange, ...]:
    """``acceptance_schedule``: [{after_tokens, accepted_drafts | acceptance}, ...], after_tokens increasing."""
    items = entry.raw("acceptance_schedule", [])
    if not isinstance(items, list):
        entry.fail("acceptance_schedule", f"expected a list of changes, got {_describe(items)}")
    changes = []
    for index, item in enumerate(items):
        change = _Entry(entry.source, f"{entry.where}: acceptance_schedule[{index}]", item)
        changes.append(AcceptanceChange(change.integer("after_tokens", minimum=1), _parse_acceptance(change)))
        change.finish(CHANGE_FIELDS)
    if any(b.after_tokens <= a.after_tokens for a, b in zip(changes, changes[1:])):
        entry.fail("acceptance_schedule", "after_tokens must strictly increase from one change to the next")
    return tuple(changes)


def _parse_acceptance(entry: _Entry) -> AcceptanceModel:
    has_fixed = entry.data.get("accepted_drafts") is not None
    has_sampled = entry.data.get("acceptance") is not None
    if has_fixed and has_sampled:
        entry.fail("acceptance", "give either accepted_drafts or acceptance, not both")
    if not has_sampled:
        return FixedAcceptance(entry.integer("accepted_drafts", 0))
    survival = entry.raw("acceptance")
    if not isinstance(survival, list) or not all(_is_probability(p) for p in survival):
        entry.fail("acceptance", f"expected a list of probabilities in [0, 1], got {_describe(survival)}")
    if any(later > earlier for earlier, later in zip(survival, survival[1:])):
        entry.fail("acceptance", f"survival probabilities must not increase with depth, got {survival}")
    return SampledAcceptance(tuple(float(p) for p in survival))


def _is_probability(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 <= value <= 1.0


def _check_unique_request_ids(top: _Entry, requests: tuple[TraceRequest, ...]) -> None:
    seen: set[str] = set()
    for index, request in enumerate(requests):
        if request.id in seen:
            raise SimulationFileError(
                f"{top.source}: requests[{index}]: field 'id': {request.id!r} is used twice; request ids must be distinct"
            )
        seen.add(request.id)


# ---------------------------------------------------------------------------
# Writing (the inverse of loading: examples, tests and generated traces)
# ---------------------------------------------------------------------------


def catalog_to_dict(catalog: SyntheticCatalog) -> dict[str, Any]:
    return {"request_slots": catalog.request_slots, "graphs": [_graph_to_dict(g) for g in catalog.graphs]}


def _graph_to_dict(graph: SyntheticGraph) -> dict[str, Any]:
    d = graph.descriptor
    out: dict[str, Any] = {"id": d.id, "kind": d.kind.value, "batch_capacity": d.batch_capacity}
    if d.prefill_capacity:
        out["prefill_capacity"] = d.prefill_capacity
    if d.kind not in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        out.update(width=d.width, proposal_depth=d.proposal_depth)
    if d.aggregate:
        out["aggregate"] = d.aggregate
    out.update(ragged=d.ragged, speculation_enabled=d.speculation_enabled)
    if d.value_source is not None:
        out["value_source"] = d.value_source.value
    if d.proposal_source is not None:
        out["proposal_source"] = d.proposal_source
    out["duration_ms"] = graph.duration_ns / 1e6
    if graph.jitter_ns:
        out["jitter_ms"] = graph.jitter_ns / 1e6
    return out


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    return {
        "seed": trace.seed,
        "policy": {k: v for k, v in _as_dict(trace.policy).items() if k not in INERT_POLICY_FIELDS},
        "requests": [_request_to_dict(r) for r in trace.requests],
        "speculation": trace.speculation,
        "reuse": trace.reuse,
        "checkpoint_rows": trace.checkpoint_rows,
        **({} if trace.adaptive_floor is None else {"adaptive_floor": trace.adaptive_floor}),
    }


def _request_to_dict(request: TraceRequest) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": request.id,
        "arrival_ms": request.arrival_ns / 1e6,
        "prompt_tokens": request.prompt_tokens,
        "max_tokens": request.max_tokens,
        "preseed_acceptance": request.preseed_acceptance,
        "proposal_source": request.proposal_source,
    }
    if request.scored_prompt:
        out["scored_prompt"] = True
    out.update(_acceptance_to_dict(request.acceptance))
    if request.acceptance_schedule:
        out["acceptance_schedule"] = [
            {"after_tokens": c.after_tokens, **_acceptance_to_dict(c.model)} for c in request.acceptance_schedule
        ]
    if request.follows is not None:
        del out["arrival_ms"]
        out.update(follows=request.follows, think_ms=request.think_ms)
    return out


def _acceptance_to_dict(model: AcceptanceModel) -> dict[str, Any]:
    if isinstance(model, FixedAcceptance):
        return {"accepted_drafts": model.accepted_drafts}
    return {"acceptance": list(model.survival)}


def dump_yaml(document: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(document, sort_keys=False))
