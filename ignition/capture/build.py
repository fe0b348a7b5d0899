"""Write a catalog folder from a ``CaptureSource`` (format: docs/catalog-format.md).

Steps, each reported to the observer: stage a folder beside the target, write
the weight sets once, copy the tokenizer, export every program, write the
manifest last, then rename the folder into place.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import save_file

from flare_contract.graphs import GraphDescriptor, GraphKind
from flare_contract.manifest import MANIFEST_NAME, ArgSpec, Manifest, ProgramEntry, StateSpec, WeightSet, file_sha256
from ignition.capture.export import export_program
from ignition.capture.source import CaptureSource
from ignition.capture.staging import staged_folder

COMPILE_MODES = ("none", "aoti")
# State programs copy tensors through flare:: ops and run no model: compiling them would buy nothing.
EXPORT_ONLY_KINDS = frozenset({GraphKind.SNAPSHOT, GraphKind.RESTORE, GraphKind.INIT})


class CaptureError(ValueError):
    """Capture cannot proceed: names what is wrong and what would be right."""


class CaptureObserver:
    """Receives progress; the CLI renders it, tests may record it. Default: silent."""

    def step(self, name: str) -> None: ...

    def programs_started(self, total: int) -> None: ...

    def program_done(self, descriptor: GraphDescriptor) -> None: ...


@dataclass(frozen=True, slots=True)
class CaptureSummary:
    path: Path
    programs_by_kind: Mapping[str, int]
    total_bytes: int
    seconds: float


def flare_version() -> str:
    try:
        return metadata.version("flare")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def write_catalog(
    source: CaptureSource, out: Path, observer: CaptureObserver | None = None, compile: str = "none", *, jobs: int = 1,
    compile_kinds: tuple[str, ...] = (), compile_max_width: int | None = None,
    compile_max_prompt: int | None = None,
) -> CaptureSummary:
    """Capture ``source`` into the catalog folder ``out``, atomically.

    ``jobs`` > 1 exports programs in that many worker processes when the source
    can be rebuilt in one (``CaptureSource.rebuild``); the catalog is the same.
    ``compile="aoti"`` also compiles the programs of ``compile_kinds`` (empty: all)
    whose width is at most ``compile_max_width`` and whose prompt capacity is at most
    ``compile_max_prompt`` (None: any).
    """
    observer = observer or CaptureObserver()
    if compile not in COMPILE_MODES:
        raise CaptureError(f"--compile {compile!r} is unknown; use one of {', '.join(COMPILE_MODES)}")
    compiled = _compiled_ids(source.graphs, compile, compile_kinds, compile_max_width, compile_max_prompt)
    started = time.perf_counter()
    with staged_folder(out) as root:
        observer.step("write weights")
        weights = _write_weights(root, source.weights)
        observer.step("copy tokenizer")
        tokenizer = _copy_tokenizer(root, source)
        programs, uses = _export_programs(root, source, weights, observer, compiled, jobs)
        weights = _with_linear_keys(weights, uses)
        observer.step("write manifest")
        manifest = dataclasses.replace(_manifest(source, weights, tokenizer, programs),
                                       compile="aoti" if compiled else "none")
        (root / MANIFEST_NAME).write_text(manifest.dump())
        total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    kinds = Counter(p.descriptor.kind.value for p in programs)
    return CaptureSummary(out, dict(sorted(kinds.items())), total, time.perf_counter() - started)


def _write_weights(root: Path, sets: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[WeightSet, ...]:
    (root / "weights").mkdir()
    written = []
    for name, tensors in sets.items():
        relative = f"weights/{name}.safetensors"
        save_file({k: t.detach().contiguous() for k, t in tensors.items()}, root / relative)
        (root / relative).chmod(0o644)  # safetensors creates 0600; a catalog is meant to be shared
        written.append(WeightSet(name, relative, file_sha256(root / relative), tuple(tensors)))
    return tuple(written)


def _copy_tokenizer(root: Path, source: CaptureSource) -> dict:
    folder = root / "tokenizer"
    folder.mkdir()
    hashes = {}
    for path in sorted(source.tokenizer_files, key=lambda p: p.name):
        shutil.copyfile(path, folder / path.name)
        hashes[path.name] = file_sha256(folder / path.name)
    return {"reference": source.tokenizer_reference, "files": hashes}


Uses = tuple[tuple[tuple[str, str], bool], ...]  # ExportedProgram.weight_uses as picklable pairs


def _with_linear_keys(weights: tuple[WeightSet, ...], uses: list[Uses]) -> tuple[WeightSet, ...]:
    """Each set with the keys that every program reads only as flare::linear's weight (and one reads)."""
    only: dict[tuple[str, str], bool] = {}
    for program in uses:
        for weight, linear in program:
            only[weight] = only.get(weight, True) and linear
    return tuple(dataclasses.replace(w, linear_keys=tuple(k for k in w.keys if only.get((w.name, k), False)))
                 for w in weights)


def _export_programs(
    root: Path, source: CaptureSource, weights: tuple[WeightSet, ...], observer: CaptureObserver,
    compiled: frozenset[str], jobs: int = 1,
) -> tuple[tuple[ProgramEntry, ...], list[Uses]]:
    (root / "programs").mkdir()
    observer.step(f"export {len(source.graphs)} programs"
                  + (f" and compile {len(compiled)} with AOTInductor" if compiled else ""))
    observer.programs_started(len(source.graphs))
    workers = min(jobs, len(source.graphs)) if source.rebuild is not None else 1
    if workers > 1:
        return _export_in_workers(root, source, weights, observer, compiled, workers)
    done = {}
    for descriptor in _compiled_first(source.graphs, compiled):
        done[descriptor.id] = _export_one(root, source, weights, descriptor, descriptor.id in compiled)
        observer.program_done(descriptor)
    return tuple(done[d.id][0] for d in source.graphs), [done[d.id][1] for d in source.graphs]


def _compiled_ids(graphs: tuple[GraphDescriptor, ...], compile: str, kinds: tuple[str, ...],
                  max_width: int | None, max_prompt: int | None = None) -> frozenset[str]:
    """The programs ``compile`` packages: of the listed kinds (empty: all), at most ``max_width`` wide and
    holding at most ``max_prompt`` prompt tokens."""
    if compile != "aoti":
        return frozenset()
    return frozenset(d.id for d in graphs if d.kind not in EXPORT_ONLY_KINDS and (not kinds or d.kind.value in kinds)
                     and (max_width is None or d.width <= max_width)
                     and (max_prompt is None or d.prefill_capacity <= max_prompt))


def _compiled_first(graphs: tuple[GraphDescriptor, ...], compiled: frozenset[str]) -> list[GraphDescriptor]:
    """The slow compiled programs start first, so parallel workers finish together."""
    return sorted(graphs, key=lambda d: d.id not in compiled)


# Each worker process rebuilds the source once (weights, builder) and keeps it here.
_WORKER_SOURCE: CaptureSource | None = None


def _worker_start(rebuild) -> None:
    global _WORKER_SOURCE
    torch.set_num_threads(1)  # the workers share the cores; one thread each avoids oversubscription
    _WORKER_SOURCE = rebuild()


def _worker_export(root: Path, weights: tuple[WeightSet, ...], descriptor: GraphDescriptor,
                   aoti: bool) -> tuple[ProgramEntry, Uses]:
    assert _WORKER_SOURCE is not None, "worker used before its source was rebuilt"
    return _export_one(root, _WORKER_SOURCE, weights, descriptor, aoti)


def _export_in_workers(
    root: Path, source: CaptureSource, weights: tuple[WeightSet, ...], observer: CaptureObserver,
    compiled: frozenset[str], workers: int,
) -> tuple[tuple[ProgramEntry, ...], list[Uses]]:
    """Export in ``workers`` fresh (spawned) processes; entries (and weight uses) come back in plan order."""
    context = multiprocessing.get_context("spawn")  # never fork a process that has started torch threads
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_start,
                             initargs=(source.rebuild,)) as pool:
        futures = {pool.submit(_worker_export, root, weights, d, d.id in compiled): d
                   for d in _compiled_first(source.graphs, compiled)}
        done: dict[str, tuple[ProgramEntry, Uses]] = {}
        for future in as_completed(futures):
            descriptor = futures[future]
            done[descriptor.id] = future.result()
            observer.program_done(descriptor)
    return tuple(done[d.id][0] for d in source.graphs), [done[d.id][1] for d in source.graphs]


def _export_one(
    root: Path, source: CaptureSource, weights: tuple[WeightSet, ...], descriptor: GraphDescriptor, aoti: bool
) -> tuple[ProgramEntry, Uses]:
    """The program's manifest entry, and which weights it reads only as flare::linear's weight."""
    relative = f"programs/{descriptor.id}.pt2"
    compiled = f"programs/{descriptor.id}.aoti.pt2" if aoti else None
    spec = source.build(descriptor)
    key_sets = {w.name: frozenset(w.keys) for w in weights}
    exported = export_program(spec, root / relative, key_sets, root / compiled if compiled else None)
    orders = {w.name: w.keys for w in weights}
    for arg in exported.inputs:
        if arg.weights is not None and exported.weight_orders[arg.name] != arg.weight_order(orders):
            raise CaptureError(f"program {descriptor.id}: input {arg.name!r} orders its weight keys differently "
                               f"from weight set {arg.weights!r}; programs must share one key order")
    entry = ProgramEntry(
        descriptor, exported.inputs, exported.outputs, relative, file_sha256(root / relative),
        compiled_file=compiled, compiled_sha256=file_sha256(root / compiled) if compiled else None,
    )
    return entry, tuple(exported.weight_uses.items())


def _state_tensors(programs: tuple[ProgramEntry, ...]) -> tuple[ArgSpec, ...]:
    """Persistent state is what programs update in place; every program must agree on its shape."""
    state: dict[str, ArgSpec] = {}
    for program in programs:
        for arg in program.inputs:
            if not arg.mutated:
                continue
            known = state.setdefault(arg.name, arg)
            if (known.shape, known.dtype) != (arg.shape, arg.dtype):
                raise CaptureError(f"state tensor {arg.name!r}: program {program.id} uses {arg.dtype}{list(arg.shape)}"
                                   f" but another uses {known.dtype}{list(known.shape)}; state must be shared")
    return tuple(state.values())


def _manifest(
    source: CaptureSource, weights: tuple[WeightSet, ...], tokenizer: dict, programs: tuple[ProgramEntry, ...]
) -> Manifest:
    return Manifest(
        flare_version=flare_version(),
        torch_version=str(torch.__version__),
        recipe=source.recipe,
        model=source.model,
        tokenizer=tokenizer,
        device=source.device,
        envelope=source.envelope,
        state=StateSpec(_state_tensors(programs), source.layout),
        weights=weights,
        programs=programs,
    )
