"""The whole capture: recipe -> capacity plan -> checkpoint -> catalog folder.

This is the one place capture meets the model code (``ignition.models``):
``model_source`` turns a resolved recipe and its plan into a ``CaptureSource``;
``capture`` runs the named startup steps and hands the source to the writer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from flare_contract.manifest import Envelope
from ignition.capacity import CapacityOptions, CapacityPlan, plan_capacity
from ignition.capacity.plan import check_options
from ignition.capture.build import COMPILE_MODES, CaptureError, CaptureObserver, CaptureSummary, write_catalog
from ignition.capture.source import CaptureSource
from ignition.capture.staging import check_target
from ignition.models.checkpoint import load_checkpoint, load_config
from ignition.models.programs import StateLayout, build_program
from ignition.models.proposals import DRAFT_PREFIX
from ignition.recipes import Recipe, load_recipe
from ignition.recipes.schema import COMPILABLE_KINDS

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# Files beside tokenizer.json that describe how to use it (chat template, specials).
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True, slots=True)
class CaptureRequest:
    """What ``ignition capture`` was asked for."""

    recipe: str  # name, alias or path to a recipe YAML
    out: Path
    model: Path | None = None  # --model: a local Hugging Face checkpoint folder
    options: CapacityOptions = CapacityOptions()
    compile: str | None = None  # --compile; None: the recipe's compile.mode
    jobs: int = 1  # worker processes exporting programs in parallel
    compile_kinds: tuple[str, ...] | None = None  # --compile-kinds; None: the recipe's compile.kinds

    def __post_init__(self) -> None:
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise CaptureError(f"--compile {self.compile!r} is unknown; use one of {', '.join(COMPILE_MODES)}")
        unknown = [k for k in self.compile_kinds or () if k not in COMPILABLE_KINDS]
        if unknown:
            raise CaptureError(f"--compile-kinds: unknown kind {unknown[0]!r}; use some of {', '.join(COMPILABLE_KINDS)}")
        if self.jobs < 1:
            raise CaptureError(f"--jobs must be >= 1, got {self.jobs}")


@dataclass(frozen=True, slots=True)
class CompileChoice:
    """What capture compiles: the request's flags over the recipe's ``compile`` defaults."""

    mode: str
    kinds: tuple[str, ...]  # empty: every kind
    note: str | None = None  # why a recipe's aoti became none (no compiler)
    max_width: int | None = None  # the recipe's compile.max_width: compiled programs verify at most this width
    max_prompt: int | None = None  # the recipe's compile.max_prompt: compiled programs hold at most this prompt


def compile_choice(request: CaptureRequest, recipe: Recipe) -> CompileChoice:
    """``--compile aoti`` without a compiler is an error; a recipe's default falls back to export only."""
    mode = request.compile or recipe.compile.mode
    kinds = request.compile_kinds if request.compile_kinds is not None else recipe.compile.kinds
    if mode == "aoti" and not have_compiler():
        if request.compile == "aoti":
            raise CaptureError("--compile aoti needs a C++ compiler (c++ or g++) on PATH; "
                               "install one or use --compile none")
        return CompileChoice("none", (), f"recipe {recipe.name} asks for compiled programs but there is no C++ "
                                         "compiler (c++ or g++): exporting only")
    if mode != "aoti":
        return CompileChoice(mode, ())
    return CompileChoice(mode, tuple(kinds), max_width=recipe.compile.max_width, max_prompt=recipe.compile.max_prompt)


def have_compiler() -> bool:
    return bool(shutil.which("c++") or shutil.which("g++"))


def capture(request: CaptureRequest, observer: CaptureObserver | None = None) -> CaptureSummary:
    """Capture ``request.recipe`` into ``request.out`` (atomically), reporting each step."""
    observer = observer or CaptureObserver()
    recipe, plan = preflight(request)
    choice = compile_choice(request, recipe)
    if choice.note:
        observer.step(choice.note)
    observer.step(f"load checkpoint {_reference(recipe.checkpoint_folder(request.model))}")
    source = model_source(recipe, plan, request.model)
    return write_catalog(source, request.out, observer, choice.mode, jobs=request.jobs, compile_kinds=choice.kinds,
                         compile_max_width=choice.max_width, compile_max_prompt=choice.max_prompt)


def preflight(request: CaptureRequest) -> tuple[Recipe, CapacityPlan]:
    """Every cheap check, before any output: bad input fails fast with one line."""
    if request.compile == "aoti" and not have_compiler():
        raise CaptureError("--compile aoti needs a C++ compiler (c++ or g++) on PATH; "
                           "install one or use --compile none")
    recipe = load_recipe(request.recipe)
    check_options(recipe, request.options)  # a flag error needs no checkpoint
    recipe = recipe.resolve(request.model)
    plan = plan_capacity(recipe, request.options)
    folder = recipe.checkpoint_folder(request.model)
    load_config(folder)  # config.json and tokenizer.json readable
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise CaptureError(f"{folder}: no model.safetensors or model.safetensors.index.json; "
                           "a checkpoint folder needs its safetensors weights")
    check_target(request.out)
    return recipe, plan


def state_layout(recipe: Recipe, plan: CapacityPlan) -> StateLayout:
    """Room for every slot to hold the full context (the runtime's allocator hands out pages)."""
    pages_per_slot = math.ceil(recipe.dims.context_length / recipe.kv_page_size)
    slots = plan.envelope.request_slots
    return StateLayout(slots, recipe.kv_page_size, slots * pages_per_slot, pages_per_slot, _dtype(recipe),
                       checkpoint_rows=plan.envelope.checkpoint_rows)


def model_source(recipe: Recipe, plan: CapacityPlan, model: Path | None = None) -> CaptureSource:
    folder = recipe.checkpoint_folder(model)
    target = load_checkpoint(folder, _dtype(recipe))
    weights = {"target": target.weights}
    draft = None
    if recipe.draft is not None and "learned" in plan.envelope.proposal_sources and plan.envelope.draft_depth:
        draft = load_checkpoint(recipe.draft.checkpoint, _dtype(recipe))
        weights["draft"] = draft.weights
    layout = state_layout(recipe, plan)
    program_weights = {**target.weights, **{DRAFT_PREFIX + k: t for k, t in weights.get("draft", {}).items()}}
    return CaptureSource(
        recipe=plain(recipe),
        model=plain(target.config),
        tokenizer_reference=f"{_reference(folder)}/{recipe.tokenizer}",
        tokenizer_files=_tokenizer_files(folder, recipe.tokenizer),
        device={"kind": "cpu", "dtype": recipe.dtype},
        envelope=_envelope(plan),
        layout=plain(layout),
        weights=weights,
        graphs=plan.graphs,
        build=lambda desc: build_program(desc, target.config, layout, program_weights,
                                         draft_config=draft.config if draft else None),
        rebuild=functools.partial(model_source, recipe, plan, model),
    )


def _dtype(recipe: Recipe) -> torch.dtype:
    return getattr(torch, recipe.dtype)


def _envelope(plan: CapacityPlan) -> Envelope:
    env = plain(plan.envelope.to_dict())
    core = {k: env.pop(k) for k in ("request_slots", "prefill_chunk", "draft_depth", "speculative_token_capacity")}
    return Envelope(**core, mixed=env.pop("mixed"), extra={**env, "max_packed_tokens": plan.max_packed_tokens})


def _tokenizer_files(folder: Path, tokenizer: str) -> tuple[Path, ...]:
    main = folder / tokenizer
    if not main.is_file():
        raise CaptureError(f"{folder}: {tokenizer} is missing; a checkpoint folder needs its tokenizer file")
    return (main, *(folder / name for name in TOKENIZER_COMPANIONS if (folder / name).is_file()))


def _reference(folder: Path) -> str:
    """Checkpoint folder as recorded: package-relative when bundled, so manifests carry no host paths."""
    resolved = folder.resolve()
    if resolved.is_relative_to(PACKAGE_ROOT):
        return f"ignition/{resolved.relative_to(PACKAGE_ROOT)}"
    return str(resolved)


def plain(value: Any) -> Any:
    """Dataclasses, enums, paths, dtypes and tuples as YAML-safe plain data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return _reference(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value
