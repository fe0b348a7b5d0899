"""The catalog manifest and the program contract it records, as plain data.

``catalog.yaml`` (docs/catalog-format.md) is written by ``ignition.capture``
and read by ``helios.catalog.load`` through these same dataclasses, so the writer
and the reader cannot drift apart. Validation beyond the shape of the data,
and everything that touches tensors or program files, stays with the reader.
Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource

FORMAT_VERSION = 4  # 4: state programs and the checkpoint store; 3: output logprobs, sampling controls,
# token history state; 2: draft state
MANIFEST_NAME = "catalog.yaml"


class CatalogError(ValueError):
    """A catalog that cannot be used, with what is wrong and what would be right."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Manifest schema
# ---------------------------------------------------------------------------


class _OneLine(dict):
    """A mapping the manifest writes on one line (signatures stay readable)."""


class _ManifestDumper(yaml.SafeDumper):
    """Writes every value in full: a manifest has no anchors or aliases, so a reader can refuse them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_ManifestDumper.add_representer(
    _OneLine, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)
)


@dataclass(frozen=True, slots=True)
class ArgSpec:
    """One program input or output, or one persistent state tensor.

    A weights input (``weights`` names its set, e.g. "target") receives the whole
    dict of that set, keyed in the set's recorded order, followed by the keys
    of each ``prefixed`` set as ``<set>.<key>`` (programs that run the draft
    take ``target`` then ``draft.*``); it has no shape.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    mutated: bool = False
    weights: str | None = None
    prefixed: tuple[str, ...] = ()

    def weight_order(self, set_keys: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
        """The dict key order of a weights input, from each set's recorded keys."""
        assert self.weights is not None, f"{self.name} is not a weights input"
        return tuple(set_keys[self.weights]) + tuple(f"{s}.{k}" for s in self.prefixed for k in set_keys[s])

    def to_dict(self) -> dict[str, Any]:
        if self.weights is not None:
            extra = {"prefixed": list(self.prefixed)} if self.prefixed else {}
            return _OneLine(name=self.name, weights=self.weights, **extra)
        return _OneLine(name=self.name, shape=list(self.shape), dtype=self.dtype, mutated=self.mutated)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ArgSpec:
        return cls(
            name=str(raw["name"]),
            shape=tuple(raw.get("shape", ())),  # judged by the loader: integers only
            dtype=str(raw.get("dtype", "")),
            mutated=bool(raw.get("mutated", False)),
            weights=raw.get("weights"),
            prefixed=tuple(raw.get("prefixed", ())),
        )


@dataclass(frozen=True, slots=True)
class WeightSet:
    """One safetensors file shared by every program; ``keys`` is the dict order programs expect.

    ``linear_keys`` are the keys that every program reads only as the weight of ``flare::linear`` (found in
    the exported graphs at capture): the runtime may lay those out for its packed kernel. Absent in catalogs
    captured before it was recorded (nothing is packed then).
    """

    name: str
    file: str
    sha256: str
    keys: tuple[str, ...]
    linear_keys: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "file": self.file, "sha256": self.sha256, "keys": list(self.keys)}
        if self.linear_keys:
            out["linear_keys"] = list(self.linear_keys)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> WeightSet:
        return cls(str(raw["name"]), str(raw["file"]), str(raw["sha256"]), tuple(raw["keys"]),
                   tuple(str(k) for k in raw.get("linear_keys", ())))


_ENVELOPE_FIELDS = ("request_slots", "prefill_chunk", "draft_depth", "speculative_token_capacity", "mixed")


@dataclass(frozen=True, slots=True)
class Envelope:
    """The capacity envelope the catalog was captured for; ``extra`` keeps planner-specific fields."""

    request_slots: int
    prefill_chunk: int
    draft_depth: int
    speculative_token_capacity: int
    mixed: bool
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        core = {name: getattr(self, name) for name in _ENVELOPE_FIELDS}
        return {**core, **dict(self.extra)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Envelope:
        missing = [name for name in _ENVELOPE_FIELDS if name not in raw]
        if missing:
            raise KeyError(f"envelope lacks {', '.join(missing)}")
        extra = {k: v for k, v in raw.items() if k not in _ENVELOPE_FIELDS}
        return cls(**{name: raw[name] for name in _ENVELOPE_FIELDS}, extra=extra)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Persistent state the runtime allocates once and every program reads/updates in place."""

    tensors: tuple[ArgSpec, ...]
    layout: Mapping[str, Any] = field(default_factory=dict)  # request_slots, page_size, ...

    def to_dict(self) -> dict[str, Any]:
        return {"layout": dict(self.layout), "tensors": [t.to_dict() for t in self.tensors]}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StateSpec:
        return cls(tuple(ArgSpec.from_dict(t) for t in raw.get("tensors", ())), dict(raw.get("layout", {})))



# Every GraphDescriptor field is written, so a field added there reaches the manifest.
_DESCRIPTOR_FIELDS = tuple(f.name for f in fields(GraphDescriptor))


def descriptor_to_dict(desc: GraphDescriptor) -> dict[str, Any]:
    raw = {name: getattr(desc, name) for name in _DESCRIPTOR_FIELDS}
    raw["kind"] = desc.kind.value
    raw["value_source"] = desc.value_source.value if desc.value_source else None
    raw["estimated_duration_ns"] = 0  # durations are learned online (C11)
    return raw


def descriptor_from_dict(raw: Mapping[str, Any]) -> GraphDescriptor:
    """Parse one descriptor; the runtime always starts its duration unknown (C11)."""
    values = {name: raw[name] for name in _DESCRIPTOR_FIELDS if name in raw}
    values["kind"] = GraphKind(raw["kind"])
    values["value_source"] = ValueSource(raw["value_source"]) if raw.get("value_source") else None
    values["estimated_duration_ns"] = 0
    return GraphDescriptor(**values)


@dataclass(frozen=True, slots=True)
class ProgramEntry:
    """One serialized program: its descriptor, call signature and file."""

    descriptor: GraphDescriptor
    inputs: tuple[ArgSpec, ...]
    outputs: tuple[ArgSpec, ...]
    file: str
    sha256: str
    compiled_file: str | None = None  # AOTInductor package (``compile: aoti`` catalogs)
    compiled_sha256: str | None = None

    @property
    def id(self) -> str:
        return self.descriptor.id

    def to_dict(self) -> dict[str, Any]:
        return {
            **descriptor_to_dict(self.descriptor),
            "inputs": [a.to_dict() for a in self.inputs],
            "outputs": [a.to_dict() for a in self.outputs],
            "file": self.file,
            "sha256": self.sha256,
            **({"compiled_file": self.compiled_file, "compiled_sha256": self.compiled_sha256}
               if self.compiled_file else {}),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ProgramEntry:
        return cls(
            descriptor=descriptor_from_dict(raw),
            inputs=tuple(ArgSpec.from_dict(a) for a in raw["inputs"]),
            outputs=tuple(ArgSpec.from_dict(a) for a in raw["outputs"]),
            file=str(raw["file"]),
            sha256=str(raw["sha256"]),
            compiled_file=raw.get("compiled_file"),
            compiled_sha256=raw.get("compiled_sha256"),
        )


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything ``catalog.yaml`` holds. Deterministic: no timestamps, no host paths."""

    flare_version: str
    torch_version: str
    recipe: Mapping[str, Any]
    model: Mapping[str, Any]
    tokenizer: Mapping[str, Any]  # {"reference": str, "files": [names under tokenizer/]}
    device: Mapping[str, Any]  # {"kind": "cpu", "dtype": "float32"}
    envelope: Envelope
    state: StateSpec
    weights: tuple[WeightSet, ...]
    programs: tuple[ProgramEntry, ...]
    compile: str = "none"
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "flare_version": self.flare_version,
            "torch_version": self.torch_version,
            "compile": self.compile,
            "recipe": dict(self.recipe),
            "model": dict(self.model),
            "tokenizer": dict(self.tokenizer),
            "device": dict(self.device),
            "envelope": self.envelope.to_dict(),
            "state": self.state.to_dict(),
            "weights": [w.to_dict() for w in self.weights],
            "programs": [p.to_dict() for p in self.programs],
        }

    def dump(self) -> str:
        return yaml.dump(self.to_dict(), Dumper=_ManifestDumper, sort_keys=False, default_flow_style=None, width=120)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Manifest:
        return cls(
            format_version=int(raw["format_version"]),
            flare_version=str(raw["flare_version"]),
            torch_version=str(raw["torch_version"]),
            compile=str(raw.get("compile", "none")),
            recipe=raw["recipe"],
            model=raw["model"],
            tokenizer=raw["tokenizer"],
            device=raw["device"],
            envelope=Envelope.from_dict(raw["envelope"]),
            state=StateSpec.from_dict(raw["state"]),
            weights=tuple(WeightSet.from_dict(w) for w in raw["weights"]),
            programs=tuple(ProgramEntry.from_dict(p) for p in raw["programs"]),
        )
