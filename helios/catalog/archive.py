"""Judge a program archive before torch reads it (docs/catalog-format.md, "Trust").

A program file is a ``torch.export.save`` zip. ``torch.export.load`` trusts
what the archive says, and several of its paths run code the archive brings:

- a weight or constant whose payload config says ``use_pickle`` goes through
  ``torch.load(weights_only=False)``; constants named ``custom_obj_*`` or
  ``opaque_obj_*`` are unpickled outright;
- non-empty sample inputs are unpickled, falling back to
  ``weights_only=False``; so is every entry of the legacy (pre-2.8) layout,
  which ``load`` tries when the current one fails;
- symbolic shape expressions (``expr_str``) are parsed by ``sympy.sympify``,
  which evaluates Python; ``guards_code`` is compiled into a Python function
  that runs on every call;
- a node's ``target`` may name any callable reachable by attribute from
  ``torch``, ``math`` or ``operator`` (``torch.ops.load_library`` loads a
  shared library), and the graph calls it;
- a ``data/aotinductor/`` folder makes ``load`` open a compiled shared library.

A program Flare captures needs none of these: weights are inputs, shapes are
fixed, example inputs are cleared, and every node calls an ``aten`` or
``flare`` operator. ``archive_problem`` names the first feature of that list an
archive uses, so an untrusted catalog never reaches them.
"""

from __future__ import annotations

import json
import re
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch.export.pt2_archive import constants as pt2

__all__ = ["OPERATOR_NAMESPACES", "archive_problem"]

OPERATOR_NAMESPACES = ("aten", "flare")  # flare: helios.ops
_MODEL = "model"  # torch.export.save writes one program under this name; load returns only it
_WEIGHTS_CONFIG = pt2.WEIGHTS_CONFIG_FILENAME_FORMAT.format(_MODEL)
_CONSTANTS_CONFIG = pt2.CONSTANTS_CONFIG_FILENAME_FORMAT.format(_MODEL)
_SAMPLE_INPUTS = pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(_MODEL)
_GRAPH = pt2.MODELS_FILENAME_FORMAT.format(_MODEL)
_FIXED_ENTRIES = frozenset({pt2.ARCHIVE_FORMAT_PATH, pt2.ARCHIVE_VERSION_PATH, "byteorder", ".data/version",
                            ".data/serialization_id", _GRAPH, _WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _SAMPLE_INPUTS})
_TARGET = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)")


def archive_problem(path: Path) -> str | None:
    """Why ``path`` could run code when torch loads it, or None for a plain captured program."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = _entries(archive)
            if isinstance(entries, str):
                return entries
            payloads = _payloads(archive, entries)
            if isinstance(payloads, str):
                return payloads
            return _extra_entry_problem(set(entries) - _FIXED_ENTRIES - payloads) or _graph_problem(
                archive.read(entries[_GRAPH]))
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"is not a readable torch.export archive ({exc.__class__.__name__})"


def _entries(archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo] | str:
    """Entries by name inside the archive's one top folder (torch reads them relative to it)."""
    infos = archive.infolist()
    if not infos or "/" not in infos[0].filename:
        return "is not a torch.export archive (no top folder; the legacy layout is unpickled on load)"
    root = infos[0].filename.split("/", 1)[0] + "/"
    entries: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if not info.filename.startswith(root):
            return f"has entry {_cut(info.filename)} outside its top folder {root!r}"
        name = info.filename[len(root):]
        if name in entries:
            return f"has entry {_cut(name)} twice (readers may disagree on which one counts)"
        entries[name] = info
    if _GRAPH not in entries:
        return f"has no {_GRAPH}"
    return entries


def _payloads(archive: zipfile.ZipFile, entries: dict[str, zipfile.ZipInfo]) -> set[str] | str:
    """The raw tensor payloads the weight and constant configs name, or why one is not raw."""
    if _SAMPLE_INPUTS in entries and entries[_SAMPLE_INPUTS].file_size:
        return f"carries pickled example inputs ({_SAMPLE_INPUTS}); a captured program has none"
    payloads: set[str] = set()
    for config_name, folder, prefix in ((_WEIGHTS_CONFIG, pt2.WEIGHTS_DIR, pt2.WEIGHT_FILENAME_PREFIX),
                                        (_CONSTANTS_CONFIG, pt2.CONSTANTS_DIR, pt2.TENSOR_CONSTANT_FILENAME_PREFIX)):
        if config_name not in entries:
            return f"has no {config_name}"
        config = json.loads(archive.read(entries[config_name]))
        config = config.get("config") if isinstance(config, dict) else None
        if not isinstance(config, dict):
            return f"{config_name} is not a payload config"
        for fqn, meta in config.items():
            problem = _payload_meta_problem(meta, prefix)
            if problem:
                return f"{folder}{fqn[:60]}: {problem}"
            payloads.add(folder + meta["path_name"])  # raw bytes, which torch reads with frombuffer
    return payloads


def _payload_meta_problem(meta: Any, prefix: str) -> str | None:
    if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
        return "malformed payload entry"
    if meta.get("use_pickle"):
        return "is pickled (torch.export.load would unpickle it with weights_only=False)"
    if not meta["path_name"].startswith(prefix) or "/" in meta["path_name"]:
        return f"payload {_cut(meta['path_name'])} is not a raw tensor (an object torch would unpickle)"
    return None


def _extra_entry_problem(names: set[str]) -> str | None:
    """An entry beyond the fixed ones and the raw payloads is something a captured program never has."""
    for name in sorted(names):
        if name.startswith(pt2.AOTINDUCTOR_DIR):
            return f"holds AOTInductor native code ({_cut(name)})"
        if name.endswith((".pt", ".pkl", ".pickle")):
            return f"holds a pickled entry {_cut(name)}"
        return f"holds an entry torch.export.save does not write for a captured program: {_cut(name)}"
    return None


def _graph_problem(text: bytes) -> str | None:
    """The graph may only call aten and flare operators, with fixed shapes and no guard code."""
    found: dict[str, Any] = {"targets": set(), "expressions": 0}

    def note(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if "expr_str" in obj:
            found["expressions"] += 1
        if "target" in obj:
            found["targets"].add(obj["target"] if isinstance(obj["target"], str) else repr(obj["target"]))
        return obj

    program = json.loads(text, object_pairs_hook=note)
    if not isinstance(program, dict):
        return f"{_GRAPH} is not a serialized program"
    if program.get("guards_code"):
        return "carries guard code (Python that torch compiles and runs on every call)"
    if found["expressions"] or program.get("range_constraints"):
        return "has symbolic shape expressions (torch parses them with sympy, which evaluates Python)"
    unknown = sorted(t for t in found["targets"] if not _is_operator(t))
    if unknown:
        return (f"calls {_cut(unknown[0])}, which is not an operator of "
                f"{' or '.join(OPERATOR_NAMESPACES)} (a graph node may name any torch callable)")
    return None


@cache
def _is_operator(target: str) -> bool:
    """``torch.ops.<ns>.<op>.<overload>`` naming a registered operator overload of an allowed namespace."""
    match = _TARGET.fullmatch(target)
    if match is None or match[1] not in OPERATOR_NAMESPACES:
        return False
    if match[1] == "flare":
        import helios.ops  # noqa: F401  (registers the flare operators)
    try:
        overload = getattr(getattr(getattr(torch.ops, match[1]), match[2]), match[3])
    except (AttributeError, RuntimeError):
        return False
    return isinstance(overload, torch._ops.OpOverload)


def _cut(value: str, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
