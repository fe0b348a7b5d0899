"""Copy a captured catalog and compile more of its programs, without capturing it again.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/compile_more.py CATALOG OUT --width-one [--programs ID,...]

An experiment tool for issue 22: the copy is the same catalog (weights and
exported programs hard-linked where the file system allows) with an
AOTInductor package (capture's settings, ``ignition.capture.export.AOTI_CONFIGS``)
added for each named program that lacks one; ``--width-one`` names every
width-one speculative program (what adaptive speculation runs when no wider
round pays). The manifest records the packages and hashes as capture would,
and its recipe section says ``compile.max_width`` when ``--width-one`` was
given. Serve the copy with ``flare run OUT --trust-catalog``. The result is
what ``ignition capture`` with the recipe's ``compile.kinds`` including
``speculative`` and ``compile.max_width: 1`` writes, in the time of the extra
compiles only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from pathlib import Path

import torch

from flare_contract.graphs import GraphKind
from flare_contract.manifest import MANIFEST_NAME, file_sha256
from helios.catalog.load import load
from ignition.capture.export import AOTI_CONFIGS


def _copy(source: Path, out: Path) -> None:
    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, out, copy_function=link_or_copy)


def _example_args(catalog, program_id: str, state: dict) -> tuple:
    """Positional arguments of the program's recorded signature: its weights, the state, zeros elsewhere."""
    entry = catalog.entry(program_id)
    named = {a.name: torch.zeros(a.shape, dtype=getattr(torch, a.dtype))
             for a in entry.inputs if a.weights is None and a.name not in state}
    return catalog.program(program_id).bind({**named, **state})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("catalog", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--programs", default="", help="comma-separated program ids to compile")
    parser.add_argument("--width-one", action="store_true", help="compile every width-one speculative program")
    args = parser.parse_args()
    torch.set_num_threads(1)
    catalog = load(args.catalog, trust=True)
    wanted = [p for p in args.programs.split(",") if p]
    if args.width_one:
        wanted += [g.id for g in catalog.descriptors if g.kind is GraphKind.SPECULATIVE and g.width == 1]
    _copy(args.catalog, args.out)
    entries = {p.id: p for p in catalog.manifest.programs}
    state = catalog.allocate_state()
    for program_id in wanted:
        entry = entries[program_id]
        if entry.compiled_file:
            continue
        started = time.perf_counter()
        relative = f"programs/{program_id}.aoti.pt2"
        exported = torch.export.load(args.catalog / entry.file)
        exported.example_inputs = (_example_args(catalog, program_id, state), {})  # capture cleared them
        torch._inductor.aoti_compile_and_package(exported, package_path=str(args.out / relative),
                                                 inductor_configs=AOTI_CONFIGS)
        entries[program_id] = dataclasses.replace(entry, compiled_file=relative,
                                                  compiled_sha256=file_sha256(args.out / relative))
        print(f"{program_id}: AOTInductor compile {time.perf_counter() - started:.1f} s", flush=True)
    recipe = dict(catalog.manifest.recipe)
    if args.width_one:
        kinds = sorted({*recipe.get("compile", {}).get("kinds", ()), "speculative"})
        recipe["compile"] = {**recipe.get("compile", {}), "kinds": kinds, "max_width": 1}
    manifest = dataclasses.replace(catalog.manifest, recipe=recipe,
                                   programs=tuple(entries[p.id] for p in catalog.manifest.programs))
    (args.out / MANIFEST_NAME).unlink()  # a hard link to the source's manifest: write a new file
    (args.out / MANIFEST_NAME).write_text(manifest.dump())
    load(args.out, trust=True)  # the copy must load (hashes, keys) before anyone serves it
    print(f"{args.out}: {len(wanted)} programs compiled")


if __name__ == "__main__":
    main()
