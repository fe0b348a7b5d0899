"""A small slice of the bundled catalog, captured once, and eager twins of its programs.

Capturing the whole bundled catalog takes minutes on two cores; the engine
needs only a few shapes to exercise every phase. The folder lives in pytest's
cache, named by a hash of everything that shapes a captured program (model
and capture code, custom ops, bundled weights, torch release), so the engine
tests and the ``flare run`` test share one capture across runs, and any change
to those sources captures afresh (under a file lock).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
from pathlib import Path

import torch

# Learned programs of both value sources (query_length, prefix_limit), a width-one
# speculative variant, and a copy (prompt lookup) program: the engine's speculation paths.
PROGRAMS = ("prefill_p64", "prefill_p256", "decode_b1", "decode_b2", "decode_b4", "spec_b2_d0_w1_p2",
            "spec_b2_d1_w2_p4", "spec_b4_d3_w4_p8_ragged_pl", "spec_b2_d1_w2_p4_copy",
            "mixed_b2_w1_p64", "mixed_b2_w2_p256_spec", "snapshot_b1", "snapshot_b2", "restore_b1", "restore_b2",
            "init_b2")
REPO = Path(__file__).resolve().parents[2]
SOURCES = ("ignition/models", "ignition/capture", "ignition/capacity", "ignition/recipes", "helios/ops",
           "helios/catalog/load.py", "tests/helios/tiny_catalog.py")  # the slice's own definition too


def source_digest() -> str:
    digest = hashlib.sha256(torch.__version__.encode() + repr(PROGRAMS).encode())
    for root in SOURCES:
        path = REPO / root
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file() and file.suffix in (".py", ".yaml", ".json", ".safetensors"):
                digest.update(file.relative_to(REPO).as_posix().encode() + file.read_bytes())
    return digest.hexdigest()[:16]


def cache_folder(config, tmp_path_factory) -> Path:
    """pytest's cache folder for this slice (the session's temp folder when caching is off)."""
    name = f"flare-tiny-slice-{source_digest()}"
    cache = getattr(config, "cache", None)
    return cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)


def tiny_catalog_path(base: Path) -> Path:
    """Capture (once) the bundled model with only ``PROGRAMS``; returns the catalog folder."""
    from ignition.capacity import CapacityOptions, plan_capacity
    from ignition.capture import write_catalog
    from ignition.capture.pipeline import model_source
    from ignition.recipes import load_recipe
    from ignition.recipes.schema import CheckpointDefaults

    folder = base / "catalog"
    with open(base / "capture.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "catalog.yaml").is_file():
            # Two checkpoint rows (the bundled recipe keeps 8 of 20 MiB each): enough to test state programs.
            recipe = dataclasses.replace(load_recipe("flare-tiny").resolve(), checkpoints=CheckpointDefaults(rows=2))
            # The slice keeps the shapes it had with 4 slots (R = 8), whatever the bundled recipe declares now.
            plan = plan_capacity(recipe, CapacityOptions(concurrency=4, speculative_token_capacity=8, mixed_prefill=True))
            graphs = tuple(g for g in plan.graphs if g.id in PROGRAMS)
            source = dataclasses.replace(model_source(recipe, plan), graphs=graphs)
            write_catalog(source, folder)
    return folder


@functools.cache
def bundled_checkpoints():
    """The bundled target and draft checkpoints, as capture loads them."""
    from ignition.models.checkpoint import load_checkpoint
    from ignition.recipes import load_recipe

    recipe = load_recipe("flare-tiny").resolve()
    dtype = getattr(torch, recipe.dtype)  # the shipped files are bf16; capture converts to the recipe dtype
    return load_checkpoint(recipe.checkpoint_folder(), dtype), load_checkpoint(recipe.draft.checkpoint, dtype)


def eager_programs(catalog):
    """``program_for`` over eager modules of the catalog's programs (same weights, same layout, the
    draft model where the catalog keeps draft state): a program's eager twin, called with named tensors."""
    from ignition.models.programs import StateLayout, build_program

    target, draft = bundled_checkpoints()
    layout_fields = catalog.state.layout
    layout = StateLayout(layout_fields["request_slots"], layout_fields["page_size"], layout_fields["num_pages"],
                         layout_fields["max_pages_per_slot"], checkpoint_rows=layout_fields.get("checkpoint_rows", 0))
    has_draft = any(t.name.startswith("draft") for t in catalog.state.tensors)  # captured with learned drafts
    weights = {**target.weights, **({f"draft.{k}": t for k, t in draft.weights.items()} if has_draft else {})}
    built = {}

    def program_for(program_id: str):
        if program_id not in built:
            spec = build_program(catalog.entry(program_id).descriptor, target.config, layout, weights,
                                 draft_config=draft.config if has_draft else None)
            built[program_id] = _named(spec, spec.example_args[0])
        return built[program_id]

    return program_for


def _named(spec, weights):
    def call(**named):
        named = {"weights": weights, **named}
        outputs = spec.module(*(named[n] for n in spec.input_names))
        return dict(zip(spec.output_names, outputs, strict=True))
    return call
