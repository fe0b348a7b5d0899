"""Read and validate a captured catalog (format: docs/catalog-format.md).

A catalog is a folder: ``catalog.yaml`` (the manifest), ``weights/*.safetensors``
stored once, one ``programs/<id>.pt2`` per descriptor, and ``tokenizer/``.
This module owns the manifest schema: ``ignition.capture`` writes it through
the same dataclasses, so reader and writer cannot drift apart.

The runtime never imports model source code (DESIGN.md): only ``helios.*``,
torch, safetensors and yaml are imported here. ``helios.ops`` is imported
before any program is loaded because the programs call those custom ops.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from helios.scheduler.types import GraphDescriptor, GraphKind, ValueSource

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ArgSpec",
    "Catalog",
    "CatalogError",
    "CatalogProgram",
    "Envelope",
    "GraphDescriptor",
    "Manifest",
    "ProgramEntry",
    "StateSpec",
    "WeightSet",
    "file_sha256",
    "load",
    "torch_release",
]

FORMAT_VERSION = 2  # 2: draft state, combined target+draft weights inputs (program contract v2)
MANIFEST_NAME = "catalog.yaml"


class CatalogError(ValueError):
    """A catalog that cannot be used, with what is wrong and what would be right."""


def torch_release(version: str = torch.__version__) -> str:
    """The torch release a program format depends on ("2.13.0+cpu" -> "2.13.0").

    The local build tag (cpu, cu128) does not change the serialized format, so a
    catalog captured on a CPU build loads under the CUDA build of that release.
    """
    return version.split("+", 1)[0]


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
    pass


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
            shape=tuple(int(n) for n in raw.get("shape", ())),
            dtype=str(raw.get("dtype", "")),
            mutated=bool(raw.get("mutated", False)),
            weights=raw.get("weights"),
            prefixed=tuple(raw.get("prefixed", ())),
        )


@dataclass(frozen=True, slots=True)
class WeightSet:
    """One safetensors file shared by every program; ``keys`` is the dict order programs expect."""

    name: str
    file: str
    sha256: str
    keys: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "sha256": self.sha256, "keys": list(self.keys)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> WeightSet:
        return cls(str(raw["name"]), str(raw["file"]), str(raw["sha256"]), tuple(raw["keys"]))


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

    def allocate(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Zeroed state tensors, by name."""
        return {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device=device) for t in self.tensors}


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


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


class CatalogProgram:
    """A loaded program: binds named inputs into the recorded order and runs.

    Weights inputs are filled from the catalog unless the caller passes them.
    Mutated inputs (caches, pending tokens, lengths) are updated in place.
    The caller may pass the whole persistent state: state tensors a program
    does not take (the draft caches, for programs that never run the draft)
    are left out.
    """

    def __init__(self, entry: ProgramEntry, module: Callable[..., Any],
                 weights: Callable[[ArgSpec], Mapping[str, torch.Tensor]], state_names: frozenset[str] = frozenset()):
        self.entry = entry
        self.module = module
        self._weights = weights
        self._state_names = state_names

    def bind(self, named: Mapping[str, Any]) -> tuple[Any, ...]:
        """Positional arguments in the program's recorded input order."""
        expected = [a.name for a in self.entry.inputs]
        unknown = sorted(set(named) - set(expected) - self._state_names)
        if unknown:
            raise CatalogError(f"program {self.entry.id}: unknown inputs {unknown}; it takes {expected}")
        return tuple(self._argument(spec, named) for spec in self.entry.inputs)

    def _argument(self, spec: ArgSpec, named: Mapping[str, Any]) -> Any:
        if spec.name in named:
            return named[spec.name]
        if spec.weights is not None:
            return self._weights(spec)
        raise CatalogError(f"program {self.entry.id}: missing input {spec.name!r}")

    def __call__(self, **named: Any) -> dict[str, Any]:
        """Run with inputs by name; returns outputs by their recorded names."""
        result = self.module(*self.bind(named))
        values = result if isinstance(result, (tuple, list)) else (result,)
        return {spec.name: value for spec, value in zip(self.entry.outputs, values, strict=True)}


class Catalog:
    """A validated catalog folder. Programs and weights load lazily, once."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self._entries = {p.id: p for p in manifest.programs}
        self._programs: dict[str, CatalogProgram] = {}
        self._weights: dict[str, dict[str, torch.Tensor]] | None = None
        self._program_weights: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}

    @property
    def descriptors(self) -> tuple[GraphDescriptor, ...]:
        """Every program's descriptor, durations unknown (C11)."""
        return tuple(replace(p.descriptor, estimated_duration_ns=0) for p in self.manifest.programs)

    @property
    def envelope(self) -> Envelope:
        return self.manifest.envelope

    @property
    def state(self) -> StateSpec:
        return self.manifest.state

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer"

    def entry(self, program_id: str) -> ProgramEntry:
        if program_id not in self._entries:
            raise CatalogError(f"{self.path}: no program {program_id!r}; it has {sorted(self._entries)}")
        return self._entries[program_id]

    @property
    def weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """Weight sets by name, each a dict in its recorded key order (read once)."""
        if self._weights is None:
            self._weights = {w.name: _read_weight_set(self.path, w) for w in self.manifest.weights}
        return self._weights

    def program_weights(self, spec: ArgSpec) -> dict[str, torch.Tensor]:
        """The dict a weights input takes: its set, then each prefixed set as ``<set>.<key>``
        (built once per combination; the tensors are shared, not copied)."""
        combination = (spec.weights, *spec.prefixed)
        if combination not in self._program_weights:
            sets = self.weights
            combined = dict(sets[spec.weights])
            for name in spec.prefixed:
                combined.update({f"{name}.{key}": tensor for key, tensor in sets[name].items()})
            self._program_weights[combination] = combined
        return self._program_weights[combination]

    def program(self, program_id: str) -> CatalogProgram:
        """The loaded program for ``program_id`` (materialized on first use, then cached).

        In an ``aoti`` catalog this is the compiled package; ``exported_program``
        gives the portable exported module of the same program.
        """
        if program_id not in self._programs:
            self._programs[program_id] = self._materialize(program_id, compiled=True)
        return self._programs[program_id]

    def exported_program(self, program_id: str) -> CatalogProgram:
        """The portable ``torch.export`` module (not cached; for checks and fallbacks)."""
        return self._materialize(program_id, compiled=False)

    def _materialize(self, program_id: str, compiled: bool) -> CatalogProgram:
        entry = self.entry(program_id)
        state = frozenset(t.name for t in self.manifest.state.tensors)
        return CatalogProgram(entry, _load_module(self.path, entry, compiled), self.program_weights, state)


def _read_weight_set(root: Path, weight_set: WeightSet) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(root / weight_set.file)
    missing = [k for k in weight_set.keys if k not in tensors]
    if missing:
        raise CatalogError(f"{root / weight_set.file}: lacks weights {missing[:5]} recorded in the manifest")
    return {key: tensors[key] for key in weight_set.keys}


def _load_module(root: Path, entry: ProgramEntry, compiled: bool) -> Any:
    """The exported module, or the AOTInductor-compiled one when asked for and present."""
    import helios.ops  # noqa: F401  (registers the custom ops the programs call)

    path = root / (entry.compiled_file if compiled and entry.compiled_file else entry.file)
    try:
        if compiled and entry.compiled_file:
            return torch._inductor.aoti_load_package(str(path))
        return torch.export.load(path).module()
    except Exception as exc:  # a corrupt archive surfaces as many exception types
        raise CatalogError(f"{path}: cannot load program {entry.id}: {exc}") from exc


def load(path: str | Path, *, verify_hashes: bool = True) -> Catalog:
    """Open and validate the catalog at ``path``.

    Checks the format version, the torch release, that every listed file is
    present, and (unless ``verify_hashes`` is False, for multi-gigabyte
    weights already verified once) the sha256 of every program, weight and
    tokenizer file. Raises ``CatalogError`` naming the problem and what was
    expected.
    """
    root = Path(path)
    manifest = _read_manifest(root)
    _check_versions(root, manifest)
    for relative, expected in _hashed_files(manifest):
        _check_file(root, relative, expected if verify_hashes else None)
    return Catalog(root, manifest)


def _read_manifest(root: Path) -> Manifest:
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CatalogError(f"{root}: not a catalog (no {MANIFEST_NAME}); capture one with `ignition capture`")
    try:
        raw = yaml.safe_load(manifest_path.read_text())
    except yaml.YAMLError as exc:
        raise CatalogError(f"{manifest_path}: not valid YAML ({exc.__class__.__name__})") from exc
    if not isinstance(raw, dict) or "format_version" not in raw:
        raise CatalogError(f"{manifest_path}: no format_version; expected a Flare catalog manifest")
    if raw["format_version"] != FORMAT_VERSION:
        raise CatalogError(
            f"{root}: catalog format version {raw['format_version']} but this Flare reads version "
            f"{FORMAT_VERSION} (program contract {FORMAT_VERSION}: draft state and in-program proposals); "
            "recapture it with `ignition capture`"
        )
    try:
        manifest = Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise CatalogError(f"{manifest_path}: malformed manifest ({exc})") from exc
    _check_weight_references(manifest_path, manifest)
    return manifest


def _check_weight_references(manifest_path: Path, manifest: Manifest) -> None:
    known = {w.name for w in manifest.weights}
    for program in manifest.programs:
        for arg in program.inputs:
            for name in (arg.weights, *arg.prefixed) if arg.weights is not None else ():
                if name not in known:
                    raise CatalogError(f"{manifest_path}: program {program.id} input {arg.name!r} takes weight set "
                                       f"{name!r}, but the catalog has only {sorted(known)}")


def _check_versions(root: Path, manifest: Manifest) -> None:
    if torch_release(manifest.torch_version) != torch_release():
        raise CatalogError(
            f"{root}: captured with torch {manifest.torch_version} but this process runs torch "
            f"{torch.__version__}; recapture it with torch {torch_release()} or run torch "
            f"{torch_release(manifest.torch_version)}"
        )


def _hashed_files(manifest: Manifest) -> list[tuple[str, str]]:
    files = [(w.file, w.sha256) for w in manifest.weights]
    files += [(p.file, p.sha256) for p in manifest.programs]
    files += [(p.compiled_file, p.compiled_sha256) for p in manifest.programs if p.compiled_file]
    files += [(f"tokenizer/{name}", digest) for name, digest in manifest.tokenizer.get("files", {}).items()]
    return files


def _check_file(root: Path, relative: str, expected: str | None) -> None:
    target = root / relative
    if not target.is_file():
        raise CatalogError(f"{target}: missing from the catalog; recapture it")
    if expected is None:
        return
    actual = file_sha256(target)
    if actual != expected:
        raise CatalogError(
            f"{target}: sha256 {actual[:12]}... does not match the manifest's {expected[:12]}... "
            "(truncated or modified); recapture the catalog"
        )
