"""Read and validate a captured catalog (format: docs/catalog-format.md).

A catalog is a folder: ``catalog.yaml`` (the manifest), ``weights/*.safetensors``
stored once, one ``programs/<id>.pt2`` per descriptor, and ``tokenizer/``.
The manifest schema itself is plain data in ``flare_contract.manifest``,
which ``ignition.capture`` writes through; this module reads it, validates
it against the files and this installation, and loads weights and programs.

The runtime never imports model source code (DESIGN.md): only ``helios.*``,
``flare_contract``, torch, safetensors and yaml are imported here. ``helios.ops`` is imported
before any program is loaded because the programs call those custom ops.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import replace
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import yaml

from flare_contract.graphs import GraphDescriptor, GraphKind
from flare_contract.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ArgSpec,
    CatalogError,
    Envelope,
    Manifest,
    ProgramEntry,
    StateSpec,
    WeightSet,
    file_sha256,
)
from helios.catalog.archive import archive_problem

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
    "flare_release",
    "load",
    "torch_release",
]


STATE_KINDS = frozenset({GraphKind.SNAPSHOT, GraphKind.RESTORE, GraphKind.INIT})


def torch_release(version: str = torch.__version__) -> str:
    """The torch release a program format depends on ("2.13.0+cpu" -> "2.13.0").

    The local build tag (cpu, cu128) does not change the serialized format, so a
    catalog captured on a CPU build loads under the CUDA build of that release.
    """
    return version.split("+", 1)[0]


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
        self._flat: _FlatCall | bool | None = None  # an AOTInductor package's direct call, built on first use
        self._checked = False  # whether an exported module's first call has checked its inputs (see __call__)
        # (name, shape, dtype) of every input a caller passes: ``bind`` checks them on every call
        self._shapes = tuple((a.name, tuple(a.shape), getattr(torch, a.dtype, None))
                             for a in entry.inputs if a.weights is None)

    def bind(self, named: Mapping[str, Any]) -> tuple[Any, ...]:
        """Positional arguments in the program's recorded input order."""
        expected = [a.name for a in self.entry.inputs]
        unknown = sorted(set(named) - set(expected) - self._state_names)
        if unknown:
            raise CatalogError(f"program {self.entry.id}: unknown inputs {unknown}; it takes {expected}")
        for name, shape, dtype in self._shapes:
            value = named.get(name)
            if value is not None and (tuple(value.shape) != shape or value.dtype != dtype):
                raise CatalogError(f"program {self.entry.id}: input {name} is {list(value.shape)} {value.dtype}, "
                                   f"but the manifest records {list(shape)} {dtype}")
        return tuple(self._argument(spec, named) for spec in self.entry.inputs)

    def _argument(self, spec: ArgSpec, named: Mapping[str, Any]) -> Any:
        if spec.name in named:
            return named[spec.name]
        if spec.weights is not None:
            return self._weights(spec)
        raise CatalogError(f"program {self.entry.id}: missing input {spec.name!r}")

    def __call__(self, **named: Any) -> dict[str, Any]:
        """Run with inputs by name; returns outputs by their recorded names."""
        flat = self._flat
        if flat is None:
            flat = self._flat = _FlatCall.of(self) or False
        result = flat(named) if flat else None
        if result is None:
            result = self.module(*self.bind(named))
            if not self._checked:
                self._stop_checking()
        values = result if isinstance(result, (tuple, list)) else (result,)
        return {spec.name: value for spec, value in zip(self.entry.outputs, values, strict=True)}

    def _stop_checking(self) -> None:
        """After its first call, an exported module no longer checks its inputs against the export's shapes.

        ``torch.export``'s unlifted module flattens and checks every input on every call (a forward pre-hook,
        about 0.2 ms of Python, most of a state program's own time at one row). The first call, the engine's
        warm-up with the manifest's shapes, is checked, so a program whose export disagrees with its manifest
        fails there with torch's message; from then on ``bind`` checks every passed input against the
        manifest (a few microseconds), which the export was found to agree with.
        """
        self._checked = True
        if getattr(self.module, "validate_inputs", None) is True:
            self.module.validate_inputs = False


class _FlatCall:
    """An AOTInductor package called with its inputs already in the order its native code takes them.

    The package's own ``__call__`` (``AOTICompiledModel``) parses its two
    tree specs from their JSON text and flattens every argument, the weight
    dicts' 60-odd tensors included, on every call: about 50 us of Python on
    the device worker before each program starts (issue 22, item 3), where
    the worker also holds the GIL the control thread is waiting for. Here
    both specs are parsed once, the weights' tensors are laid out once (the
    catalog's tensors, bound at load, never change), and a call only looks
    up its named inputs. The flat list is the one the package's wrapper
    would build (``test_a_compiled_program_gets_the_flat_inputs_its_own_wrapper_builds``);
    anything this layout does not cover (a weights input passed by the
    caller, an unknown or missing name) is left to the ordinary path.
    """

    __slots__ = ("_layout", "_accepted", "_run", "_unflatten", "_out_spec")

    def __init__(self, layout: tuple, accepted: frozenset[str], run: Callable, out_spec: Any) -> None:
        from torch.utils import _pytree as pytree

        self._layout = layout  # per recorded input: its name, or the weight tensors bound at load
        self._accepted = accepted  # names a call may pass: the non-weight inputs and the persistent state
        self._run = run
        self._out_spec = out_spec
        # a flat tuple of outputs (every program's) is the loader's list as a tuple: no tree to rebuild
        flat_tuple = out_spec.type is tuple and all(child.is_leaf() for child in out_spec.children())
        self._unflatten = (lambda values, _: tuple(values)) if flat_tuple else pytree.tree_unflatten

    @classmethod
    def of(cls, program: "CatalogProgram") -> "_FlatCall | None":
        """The direct call of ``program``'s module if it is an AOTInductor package, else None."""
        try:  # where torch 2.13 keeps it; another release may move it, and then the package's own call serves
            from torch.export.pt2_archive._package import AOTICompiledModel
        except ImportError:
            return None
        from torch.utils import _pytree as pytree

        from helios.catalog.released import released_run

        if not isinstance(program.module, AOTICompiledModel):
            return None
        loader = program.module.loader
        in_text, out_text = loader.get_call_spec()
        in_spec, out_spec = pytree.treespec_loads(in_text), pytree.treespec_loads(out_text)
        layout = tuple(tuple(pytree.tree_leaves(program._weights(spec))) if spec.weights is not None else spec.name
                       for spec in program.entry.inputs)
        if sum(len(item) if isinstance(item, tuple) else 1 for item in layout) != in_spec.num_leaves:
            return None  # not the layout this package was compiled for: its own wrapper says what is wrong
        accepted = frozenset(spec.name for spec in program.entry.inputs if spec.weights is None) | program._state_names
        return cls(layout, accepted, released_run(loader) or loader.boxed_run, out_spec)

    def __call__(self, named: Mapping[str, Any]) -> Any:
        """The program's outputs, or None when ``named`` is not a call this layout covers."""
        if not named.keys() <= self._accepted:
            return None
        flat = []
        try:
            for item in self._layout:
                if isinstance(item, str):
                    flat.append(named[item])
                else:
                    flat.extend(item)
        except KeyError:
            return None  # a missing input: the ordinary path names it
        return self._unflatten(self._run(flat), self._out_spec)


class Catalog:
    """A validated catalog folder. Programs and weights load lazily, once.

    ``trusted`` (``--trust-catalog``): programs load as torch finds them,
    AOTInductor packages included. Otherwise every program archive is
    inspected before torch reads it, and compiled packages are refused
    (docs/catalog-format.md, "Trust").
    """

    def __init__(self, path: Path, manifest: Manifest, trusted: bool = False):
        self.path = path
        self.manifest = manifest
        self.trusted = trusted
        self._entries = {p.id: p for p in manifest.programs}
        self._inspected: set[str] = set()
        self._programs: dict[str, CatalogProgram] = {}
        self._weights: dict[str, dict[str, torch.Tensor]] | None = None
        self._program_weights: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        self._packed: int | None = None  # pack_linear_weights's count, once it has run

    @property
    def descriptors(self) -> tuple[GraphDescriptor, ...]:
        """Every inference program's descriptor, durations unknown (C11); state programs are
        ``state_descriptors``."""
        return tuple(replace(p.descriptor, estimated_duration_ns=0) for p in self.manifest.programs
                     if p.descriptor.kind not in STATE_KINDS)

    @property
    def state_descriptors(self) -> tuple[GraphDescriptor, ...]:
        """The snapshot, restore and init programs' descriptors (docs/checkpoints.md), durations unknown."""
        return tuple(replace(p.descriptor, estimated_duration_ns=0) for p in self.manifest.programs
                     if p.descriptor.kind in STATE_KINDS)

    @property
    def checkpoint_rows(self) -> int:
        """Rows of the checkpoint store (0: the catalog keeps none)."""
        return int(self.manifest.state.layout.get("checkpoint_rows", 0)) if self.has_checkpoints else 0

    @property
    def has_checkpoints(self) -> bool:
        return any(t.name == "checkpoint_k" for t in self.manifest.state.tensors)

    @property
    def envelope(self) -> Envelope:
        return self.manifest.envelope

    @property
    def state(self) -> StateSpec:
        return self.manifest.state

    def allocate_state(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The persistent state every program reads and updates, zeroed, by tensor name."""
        return {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device=device)
                for t in self.state.tensors}

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

    def pack_linear_weights(self) -> int:
        """Lay out each weight set's ``linear_keys`` for ``flare::linear``'s packed kernel, in place of the
        tensors read (csrc/flare_ops.cpp, "Packed weights"), where this process can (``helios.ops.kernels.
        packs_linear_weights``), and the other float32 weights, as they are, into one huge-page allocation
        beside them (``flare::gather_weights``); the programs then take the new tensors. Call it before the
        first program runs (the engine does, on a CPU device). Returns how many tensors are packed; runs
        once (later calls return the same count and change nothing)."""
        from helios.ops import kernels

        if not kernels.packs_linear_weights():
            return 0
        if self._packed is not None:
            return self._packed
        sets = self.weights
        # every set's in one allocation, in the order a step reads them (flare::pack_linear_weights)
        chosen = [(w.name, key) for w in self.manifest.weights for key in w.linear_keys
                  if sets[w.name][key].dim() == 2 and sets[w.name][key].dtype == torch.float32]  # float32 only
        for (name, key), tensor in zip(chosen, torch.ops.flare.pack_linear_weights([sets[n][k] for n, k in chosen])):
            sets[name][key] = tensor
        # the rest (norms, a tied embedding its head's product reads) in one huge-page allocation too
        linear = set(chosen)
        rest = [(n, k) for n, tensors in sets.items() for k in tensors if (n, k) not in linear]
        for (name, key), tensor in zip(rest, torch.ops.flare.gather_weights([sets[n][k] for n, k in rest])):
            sets[name][key] = tensor
        # the combined dicts, and any program already bound to them, name the tensors read before
        self._program_weights.clear()
        self._programs.clear()
        self._packed = len(chosen)
        return self._packed

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

    def check_programs(self) -> None:
        """Inspect every program archive now (``flare run`` does, before warm-up), unless trusted."""
        for entry in self.manifest.programs:
            self._check_program(entry, compiled=True)

    def _check_program(self, entry: ProgramEntry, compiled: bool) -> None:
        if self.trusted:
            return
        if compiled and entry.compiled_file:
            raise CatalogError(f"{self.path}: program {entry.id} is an AOTInductor package (compile: aoti), "
                               "native code that runs when loaded; pass --trust-catalog if you trust this catalog")
        if entry.id not in self._inspected:
            problem = archive_problem(self.path / entry.file)
            if problem:
                raise CatalogError(f"{self.path / entry.file}: program {entry.id} {problem}; refused: it could run "
                                   "code when loaded (pass --trust-catalog only if you trust its source)")
            self._inspected.add(entry.id)

    def _materialize(self, program_id: str, compiled: bool) -> CatalogProgram:
        entry = self.entry(program_id)
        self._check_program(entry, compiled)
        state = frozenset(t.name for t in self.manifest.state.tensors)
        return CatalogProgram(entry, _load_module(self.path, entry, compiled), self.program_weights, state)


def _read_weight_set(root: Path, weight_set: WeightSet) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(root / weight_set.file)
    except Exception as exc:  # safetensors raises its own error type for a damaged file
        raise CatalogError(f"{root / weight_set.file}: cannot read weights ({_cut(str(exc))})") from None
    missing = [k for k in weight_set.keys if k not in tensors]
    if missing:
        raise CatalogError(f"{root / weight_set.file}: lacks weights {missing[:5]} recorded in the manifest")
    return _aligned({key: tensors[key] for key in weight_set.keys})


# The vector kernels load whole 64-byte lines of a weight; safetensors places each tensor right after the
# one before it (8-byte alignment), so most tensors of a mapped file straddle cache lines and every vector
# load of them is split in two (docs/benchmarks.md, "Aligned weights and the sampling op").
WEIGHT_ALIGNMENT = 64


def _aligned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors, each starting on a 64-byte boundary: where one of the file's does not, all are
    copied into the allocator's aligned memory, so no view keeps the file's mapping (and its pages) alive
    beside the copies."""
    if all(t.data_ptr() % WEIGHT_ALIGNMENT == 0 for t in tensors.values()):
        return tensors
    return {key: t.clone(memory_format=torch.contiguous_format) for key, t in tensors.items()}


class _SchemaTypeHints:
    """torch's ``typing`` module as its export deserializer sees it, with the schema's type hints resolved once.

    torch 2.13's ``_dict_to_dataclass`` resolves the annotations of a schema
    dataclass (``typing.get_type_hints``) again for every object it decodes:
    32,000 calls and about 40% of a program's load time for a four-row
    speculative program. The schema classes are torch's own and never change,
    so their hints are resolved once per class; every other call passes through.
    """

    def __init__(self, real: Any, schema_namespace: dict) -> None:
        self._real, self._namespace, self._hints = real, schema_namespace, {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        if globalns is not self._namespace or localns is not None or include_extras:
            return self._real.get_type_hints(obj, globalns, localns, include_extras)
        hints = self._hints.get(obj)
        if hints is None:
            hints = self._hints[obj] = self._real.get_type_hints(obj, globalns=globalns)
        return hints


def _memoize_schema_type_hints() -> None:
    """Install ``_SchemaTypeHints`` in torch's export deserializer (once; a torch without it is left alone)."""
    try:
        from torch._export.serde import schema, serialize
    except ImportError:
        return
    current = getattr(serialize, "typing", None)
    if current is not None and not isinstance(current, _SchemaTypeHints):
        serialize.typing = _SchemaTypeHints(current, vars(schema))


def _load_module(root: Path, entry: ProgramEntry, compiled: bool) -> Any:
    """The exported module, or the AOTInductor-compiled one when asked for and present."""
    import helios.ops  # noqa: F401  (registers the custom ops the programs call)

    _memoize_schema_type_hints()
    path = root / (entry.compiled_file if compiled and entry.compiled_file else entry.file)
    try:
        if compiled and entry.compiled_file:
            return torch._inductor.aoti_load_package(str(path))
        return torch.export.load(path).module()
    except Exception as exc:  # a corrupt archive surfaces as many exception types
        raise CatalogError(f"{path}: cannot load program {entry.id}: {_cut(str(exc), 300)}") from exc


def load(path: str | Path, *, verify_hashes: bool = True, trust: bool = False) -> Catalog:
    """Open and validate the catalog at ``path``.

    Checks the manifest (safe YAML without aliases, every section's types, the
    state layout), the format version, the Flare and torch releases, that
    every path the manifest names lies inside the folder (before any file is
    read), that every listed file is present, and (unless ``verify_hashes`` is
    False, for multi-gigabyte weights already verified once) the sha256 of
    every program, weight and tokenizer file, and that each weight file holds
    the tensors recorded for it. Raises ``CatalogError`` naming the problem and
    what was expected. ``trust`` is ``--trust-catalog`` (see ``Catalog``).
    """
    root = Path(path)
    manifest = _read_manifest(root)
    _check_versions(root, manifest)
    files = _hashed_files(root, manifest)
    for relative, _ in files:
        _inside(root, relative)
    _check_tokenizer_listing(root, manifest)
    for relative, expected in files:
        _check_file(root, relative, expected if verify_hashes else None)
    for weight_set in manifest.weights:
        _check_weight_file(root, weight_set)
    return Catalog(root, manifest, trusted=trust)


def _read_manifest(root: Path) -> Manifest:
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CatalogError(f"{root}: not a catalog (no {MANIFEST_NAME}); capture one with `ignition capture`")
    raw = _parse_manifest(manifest_path)
    _check_format_version(root, raw["format_version"])
    try:
        manifest = Manifest.from_dict(raw)
        _check_manifest(manifest)
    except CatalogError as exc:
        raise CatalogError(f"{manifest_path}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CatalogError(f"{manifest_path}: malformed manifest ({exc.__class__.__name__}: {_cut(str(exc))})") from None
    return manifest


def _parse_manifest(manifest_path: Path) -> dict[str, Any]:
    try:
        text = manifest_path.read_text(encoding="utf-8")
        _check_yaml_shape(manifest_path, text)
        raw = yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise CatalogError(f"{manifest_path}: not valid YAML{at} ({exc.__class__.__name__})") from None
    except UnicodeDecodeError:
        raise CatalogError(f"{manifest_path}: not valid YAML (not UTF-8 text)") from None
    if not isinstance(raw, dict) or "format_version" not in raw:
        raise CatalogError(f"{manifest_path}: no format_version; expected a Flare catalog manifest")
    return raw


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MAX_YAML_DEPTH = 32  # a manifest nests five deep (programs, entry, inputs, input, shape)


def _check_yaml_shape(manifest_path: Path, text: str) -> None:
    """No aliases and no deep nesting, judged on the event stream before any value is built.

    A few hundred bytes of nested aliases expand to billions of values in any
    walk over them, and deep nesting exhausts the composer's stack; Flare
    writes neither.
    """
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, yaml.AliasEvent):
            raise CatalogError(f"{manifest_path}: a YAML alias at line {event.start_mark.line + 1} "
                               "(manifests have none)")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > _MAX_YAML_DEPTH:
                raise CatalogError(f"{manifest_path}: nested more than {_MAX_YAML_DEPTH} deep at line "
                                   f"{event.start_mark.line + 1} (a manifest nests about five)")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_format_version(root: Path, version: Any) -> None:
    if type(version) is not int:
        raise CatalogError(f"{root / MANIFEST_NAME}: format_version must be the integer {FORMAT_VERSION}, "
                           f"got {_cut(repr(version))} ({type(version).__name__})")
    if version != FORMAT_VERSION:
        raise CatalogError(
            f"{root}: catalog format version {version} but this Flare reads version "
            f"{FORMAT_VERSION} (program contract {FORMAT_VERSION}: snapshot, restore and init programs and the "
            "checkpoint store, on top of output logprobs, sampling controls and token history state); "
            "recapture it with `ignition capture`"
        )


def _cut(text: str, limit: int = 120) -> str:
    """A value quoted in a one-line error, cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------
# What a manifest must hold beyond its keys
# ---------------------------------------------------------------------------

_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
_DEVICE_KINDS = ("cpu", "cuda")
_PAGED_LAYOUT = ("request_slots", "page_size", "num_pages", "max_pages_per_slot")

# The recipe section is ignition's resolved recipe as plain data. helios never imports ignition, so the field
# names are listed here (tests/helios/test_corrupt_catalogs.py keeps them equal to ignition.recipes.schema).
_DIMENSION_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings"})
_SOURCE_KEYS = {"checkpoint": None, "dimensions": _DIMENSION_KEYS}
RECIPE_KEYS: Mapping[str, Any] = {
    "name": None, "architecture": None, "dtype": None, "aliases": None, "description": None, "tokenizer": None,
    "kv_page_size": None, "source": None, "target": _SOURCE_KEYS, "draft": _SOURCE_KEYS,
    "compile": frozenset({"mode", "kinds", "max_width", "max_prompt"}), "checkpoints": frozenset({"rows"}),
    "capacity": frozenset({"concurrency", "prompt_buckets", "drafts", "proposal_sources", "mixed_capture",
                           "request_buckets", "completion_token_capacity", "speculative_token_capacity"}),
}


def _check_manifest(manifest: Manifest) -> None:
    for section in ("recipe", "model", "tokenizer", "device"):
        if not isinstance(getattr(manifest, section), Mapping):
            raise CatalogError(f"{section}: expected a mapping")
    _check_flare_version(manifest.flare_version)
    _check_recipe_keys(manifest.recipe, RECIPE_KEYS, "recipe")
    _check_device(manifest.device)
    _check_envelope(manifest.envelope)
    _check_unique("program id", [p.id for p in manifest.programs])
    _check_unique("weight set", [w.name for w in manifest.weights])
    for weight_set in manifest.weights:
        keys = set(weight_set.keys)
        stray = [k for k in weight_set.linear_keys if k not in keys]
        if stray:
            raise CatalogError(f"weight set {weight_set.name!r}: linear_keys {stray[:3]} are not among its keys")
    _check_state(manifest.state, manifest.envelope)
    for program in manifest.programs:
        _check_program_signature(program, manifest)


def flare_release() -> str:
    """This Flare's version ("0+unknown" when running from a source tree that is not installed)."""
    try:
        return metadata.version("flare")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _release_numbers(version: str) -> tuple[int, ...] | None:
    match = re.fullmatch(r"(\d+(?:\.\d+)*)([.+-]?[0-9A-Za-z][0-9A-Za-z.+-]*)?", version)
    return tuple(int(n) for n in match[1].split(".")) if match else None


def _check_flare_version(version: str) -> None:
    """A catalog from a newer Flare may rely on what this one cannot do; it is refused, not guessed at."""
    theirs, ours = _release_numbers(version), _release_numbers(flare_release())
    if theirs is None:
        raise CatalogError(f"flare_version {_cut(repr(version))} is not a version (e.g. {flare_release()})")
    if ours is not None and flare_release() != "0+unknown" and _padded(theirs, ours) > _padded(ours, theirs):
        raise CatalogError(f"captured by Flare {version}, newer than this Flare {flare_release()}; "
                           "upgrade Flare, or recapture the catalog with this one")


def _padded(numbers: tuple[int, ...], other: tuple[int, ...]) -> tuple[int, ...]:
    return numbers + (0,) * (len(other) - len(numbers))


def _check_recipe_keys(raw: Any, allowed: Any, where: str) -> None:
    """Every key of the recipe section is a recipe field (nested sections too); values are not judged."""
    if allowed is None or raw is None or not isinstance(raw, Mapping):
        return
    for key, value in raw.items():
        if key not in allowed:
            names = ", ".join(sorted(allowed))
            raise CatalogError(f"{where}: unknown key {_cut(repr(key), 60)}; a recipe section has {names}")
        if isinstance(allowed, Mapping):
            _check_recipe_keys(value, allowed[key], f"{where}.{key}")


def _check_device(device: Mapping[str, Any]) -> None:
    if device.get("kind") not in _DEVICE_KINDS:
        raise CatalogError(f"device.kind {_cut(repr(device.get('kind')))} is not one of {', '.join(_DEVICE_KINDS)}")
    if device.get("dtype") not in _DTYPES:
        raise CatalogError(f"device.dtype {_cut(repr(device.get('dtype')))} is not one of {', '.join(_DTYPES)}")


def _check_envelope(envelope: Envelope) -> None:
    for name in ("request_slots", "prefill_chunk", "draft_depth", "speculative_token_capacity"):
        _require_count(f"envelope.{name}", getattr(envelope, name), 1 if name == "request_slots" else 0)
    if not isinstance(envelope.mixed, bool):
        raise CatalogError(f"envelope.mixed must be true or false, got {_cut(repr(envelope.mixed))}")


def _require_count(where: str, value: Any, low: int) -> None:
    if type(value) is not int or value < low:
        raise CatalogError(f"{where} must be an integer >= {low}, got {_cut(repr(value))}")


def _check_unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise CatalogError(f"{what} {_cut(repr(name), 60)} is listed twice")
        seen.add(name)


def _check_state(state: StateSpec, envelope: Envelope) -> None:
    """Shapes and dtypes the runtime can allocate, and a layout that agrees with them.

    A state with a paged KV cache (``k_cache``, program contract v2) needs the
    whole page layout, and every ``*_cache`` tensor is ``[layers, num_pages,
    page_size, heads, head_dim]``; ``pending`` and ``seq_lens`` hold one entry
    per request slot.
    """
    layout = state.layout
    for tensor in state.tensors:
        _check_tensor_spec(f"state tensor {tensor.name}", tensor, low=1)
    for key in (*_PAGED_LAYOUT, "context"):
        if key in layout:
            _require_count(f"state.layout.{key}", layout[key], 1)
    if "checkpoint_rows" in layout:
        _require_count("state.layout.checkpoint_rows", layout["checkpoint_rows"], 0)
    if "request_slots" in layout and layout["request_slots"] != envelope.request_slots:
        raise CatalogError(f"state.layout.request_slots {layout['request_slots']} differs from "
                           f"envelope.request_slots {envelope.request_slots}")
    names = {t.name: t for t in state.tensors}
    if "k_cache" in names:
        _check_paged_state(layout, names)
    if any(name.startswith("checkpoint_") for name in names):
        _check_checkpoint_store(layout, names)


def _check_paged_state(layout: Mapping[str, Any], tensors: Mapping[str, ArgSpec]) -> None:
    missing = [key for key in _PAGED_LAYOUT if key not in layout]
    if missing:
        raise CatalogError(f"state.layout lacks {', '.join(missing)} (a paged cache needs "
                           f"{', '.join(_PAGED_LAYOUT)}; it has {', '.join(map(str, layout)) or 'nothing'})")
    for tensor in tensors.values():
        if tensor.name.endswith("_cache"):
            if len(tensor.shape) != 5 or tensor.shape[1:3] != (layout["num_pages"], layout["page_size"]):
                raise CatalogError(
                    f"state tensor {tensor.name} has shape {list(tensor.shape)}, but the layout's "
                    f"{layout['num_pages']} pages of {layout['page_size']} need [layers, {layout['num_pages']}, "
                    f"{layout['page_size']}, heads, head_dim]")
    for name in ("pending", "seq_lens"):
        if name in tensors and tensors[name].shape != (layout["request_slots"],):
            raise CatalogError(f"state tensor {name} has shape {list(tensors[name].shape)}, but the layout has "
                               f"{layout['request_slots']} request slots")


def _check_checkpoint_store(layout: Mapping[str, Any], tensors: Mapping[str, ArgSpec]) -> None:
    """Checkpoint rows of a full context each: ``checkpoint_k``/``_v`` (and the draft's) shaped like their
    slot caches with ``checkpoint_rows * max_pages_per_slot`` pages, one entry per row of the others."""
    rows = layout.get("checkpoint_rows", 0)
    if "k_cache" not in tensors or not rows:
        raise CatalogError("state has checkpoint tensors but no paged cache with state.layout.checkpoint_rows >= 1")
    pages = rows * layout["max_pages_per_slot"]
    for name, slot_name in _CHECKPOINT_PAIRS.items():
        if (name in tensors) != (slot_name in tensors):
            raise CatalogError(f"state has one of {slot_name} and {name} without the other: the checkpoint store "
                               "holds a copy of every per-slot tensor")
        if name not in tensors:
            continue
        slot, row = tensors[slot_name], tensors[name]
        expected = (slot.shape[0], pages, *slot.shape[2:]) if slot_name.endswith("_cache") else (rows, *slot.shape[1:])
        if row.shape != expected or row.dtype != slot.dtype:
            raise CatalogError(f"state tensor {name} is {list(row.shape)} {row.dtype}, but {rows} checkpoint rows "
                               f"beside {slot_name} need {list(expected)} {slot.dtype}")


_CHECKPOINT_PAIRS = {"checkpoint_k": "k_cache", "checkpoint_v": "v_cache", "checkpoint_draft_k": "draft_k_cache",
                     "checkpoint_draft_v": "draft_v_cache", "checkpoint_pending": "pending",
                     "checkpoint_seq_lens": "seq_lens", "checkpoint_token_counts": "token_counts",
                     "checkpoint_prompt_seen": "prompt_seen"}


def _check_tensor_spec(where: str, spec: ArgSpec, low: int) -> None:
    if spec.dtype not in _DTYPES:
        raise CatalogError(f"{where}: dtype {_cut(repr(spec.dtype))} is not one of {', '.join(_DTYPES)}")
    if any(type(n) is not int or n < low for n in spec.shape):
        raise CatalogError(f"{where}: shape {_cut(str(list(spec.shape)))} needs integers >= {low}")


_DESCRIPTOR_INTS = ("batch_capacity", "proposal_depth", "width", "aggregate", "prefill_capacity", "confidence_width")
_DESCRIPTOR_BOOLS = ("ragged", "speculation_enabled")


def _check_program_signature(program: ProgramEntry, manifest: Manifest) -> None:
    """Descriptor fields of their types; tensor inputs and outputs the runtime can build; state inputs
    exactly as the state records them."""
    desc = program.descriptor
    if not isinstance(desc.id, str) or not desc.id:
        raise CatalogError(f"program id {_cut(repr(desc.id))} is not a name")
    for name in _DESCRIPTOR_INTS:
        _require_count(f"program {desc.id} {name}", getattr(desc, name), 0)
    for name in _DESCRIPTOR_BOOLS:
        if not isinstance(getattr(desc, name), bool):
            raise CatalogError(f"program {desc.id} {name} must be true or false, got {getattr(desc, name)!r}")
    known = {w.name for w in manifest.weights}
    state = {t.name: t for t in manifest.state.tensors}
    for arg in program.inputs:
        if arg.weights is not None:
            for name in (arg.weights, *arg.prefixed):
                if name not in known:
                    raise CatalogError(f"program {program.id} input {arg.name!r} takes weight set "
                                       f"{name!r}, but the catalog has only {sorted(known)}")
            continue
        _check_tensor_spec(f"program {program.id} input {arg.name}", arg, low=0)
        if arg.name in state and (arg.shape, arg.dtype) != (state[arg.name].shape, state[arg.name].dtype):
            raise CatalogError(f"program {program.id} input {arg.name} is {list(arg.shape)} {arg.dtype}, but the "
                               f"state records {list(state[arg.name].shape)} {state[arg.name].dtype}")
    for arg in program.outputs:
        _check_tensor_spec(f"program {program.id} output {arg.name}", arg, low=0)


def _check_versions(root: Path, manifest: Manifest) -> None:
    if torch_release(manifest.torch_version) != torch_release():
        raise CatalogError(
            f"{root}: captured with torch {manifest.torch_version} but this process runs torch "
            f"{torch.__version__}; recapture it with torch {torch_release()} or run torch "
            f"{torch_release(manifest.torch_version)}"
        )


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def _hashed_files(root: Path, manifest: Manifest) -> list[tuple[str, str]]:
    files = [(w.file, w.sha256) for w in manifest.weights]
    files += [(p.file, p.sha256) for p in manifest.programs]
    files += [(p.compiled_file, p.compiled_sha256) for p in manifest.programs if p.compiled_file]
    listed = manifest.tokenizer.get("files", {})
    if not isinstance(listed, Mapping):
        raise CatalogError(f"{root / MANIFEST_NAME}: tokenizer.files must map file names to sha256 digests")
    for name, digest in listed.items():
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise CatalogError(f"{root / MANIFEST_NAME}: tokenizer file {_cut(repr(name))} is not a plain file name")
        files.append((f"tokenizer/{name}", str(digest)))
    return files


def _inside(root: Path, relative: Any) -> Path:
    """``root / relative``, refusing absolute paths, ``..``, and symlinks that leave (or loop within) ``root``."""
    where = root / MANIFEST_NAME
    if not isinstance(relative, str) or not relative:
        raise CatalogError(f"{where}: file {_cut(repr(relative))} is not a path")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or ".." in pure.parts or "\\" in relative or pure.as_posix() != relative:
        raise CatalogError(f"{where}: file {_cut(repr(relative))} must be a plain relative path inside the "
                           "catalog (no leading /, no .., no ./ or //)")
    target = root / relative
    try:
        resolved = target.resolve()
    except RuntimeError:
        raise CatalogError(f"{target}: a symlink loop; a catalog's files are plain files inside its folder") from None
    except OSError as exc:
        raise CatalogError(f"{target}: cannot be resolved ({exc.strerror})") from None
    if not resolved.is_relative_to(root.resolve()):
        raise CatalogError(f"{target}: leads outside the catalog (to {_cut(str(resolved))}); "
                           "a catalog's files must all lie inside its folder")
    return target


def _check_tokenizer_listing(root: Path, manifest: Manifest) -> None:
    """The runtime reads tokenizer.json and, when present, tokenizer_config.json: both must be listed (hashed)."""
    listed = set(manifest.tokenizer.get("files", {}))
    if "tokenizer.json" not in listed:
        raise CatalogError(f"{root / MANIFEST_NAME}: tokenizer.files does not list tokenizer.json")
    config = root / "tokenizer" / "tokenizer_config.json"
    if "tokenizer_config.json" not in listed and (config.exists() or config.is_symlink()):
        raise CatalogError(f"{config}: present but not listed in the manifest's tokenizer.files (so not hashed)")


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


def _check_weight_file(root: Path, weight_set: WeightSet) -> None:
    """The safetensors header must describe a file of this size holding every recorded key.

    A hash only proves the file is the one the manifest names; a rewritten
    manifest can name a truncated file, which would fail only at warm-up.
    """
    path = root / weight_set.file
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        header_size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < header_size <= min(size - 8, 100 << 20):
            raise CatalogError(f"{path}: not a safetensors file (its header does not fit in {size} bytes)")
        try:
            header = json.loads(handle.read(header_size))
        except (ValueError, UnicodeDecodeError):
            raise CatalogError(f"{path}: not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise CatalogError(f"{path}: not a safetensors file (unreadable header)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    end = max((int(v.get("data_offsets", (0, 0))[1]) for v in tensors.values()), default=0)
    if 8 + header_size + end != size:
        raise CatalogError(f"{path}: {size} bytes, but its header describes {8 + header_size + end} "
                           "(truncated or padded); recapture the catalog")
    missing = [key for key in weight_set.keys if key not in tensors]
    if missing:
        raise CatalogError(f"{path}: lacks weights {missing[:5]} recorded in the manifest")
