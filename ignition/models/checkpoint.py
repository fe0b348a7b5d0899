"""Load a local Hugging Face-format Qwen3 folder: config, safetensors weights, tokenizer size.

A folder holds ``config.json``, ``tokenizer.json`` and either
``model.safetensors`` or shards named by ``model.safetensors.index.json``.
Anything missing or malformed raises one ``ModelLoadError`` naming the folder
and the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ignition.models.qwen3 import ModelConfigError, Qwen3Config, Weights


class ModelLoadError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names folder and file."""


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    config: Qwen3Config
    weights: Weights  # exactly config.weight_keys(), in that order


def load_config(folder: str | Path) -> Qwen3Config:
    """The model config, with ``output_vocab_size`` taken from the tokenizer."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a folder (expected a Hugging Face checkpoint folder)")
    hf = _read_json(folder, "config.json")
    try:
        config = Qwen3Config.from_hf(hf)
    except ModelConfigError as err:
        raise ModelLoadError(f"{folder / 'config.json'}: {err}") from None
    return replace(config, output_vocab_size=min(tokenizer_size(folder), config.vocab_size))


def load_checkpoint(folder: str | Path, dtype: torch.dtype | None = None) -> Checkpoint:
    """Config and weights of a Qwen3 folder; ``dtype`` converts floating weights if given."""
    folder = Path(folder)
    config = load_config(folder)
    stored = _read_weights(folder)
    weights: Weights = {}
    for key, shape in config.weight_shapes().items():
        if key not in stored:
            raise ModelLoadError(f"{folder}: the safetensors weights lack {key!r}")
        tensor = stored[key]
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{folder}: {key} has shape {tuple(tensor.shape)}, config.json implies {shape}")
        weights[key] = tensor.to(dtype) if dtype is not None else tensor
    return Checkpoint(folder, config, weights)


def tokenizer_size(folder: Path) -> int:
    """One past the largest id tokenizer.json defines (its vocabulary plus added tokens)."""
    tok = _read_json(folder, "tokenizer.json")
    try:
        ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    except (KeyError, TypeError, AttributeError):
        raise ModelLoadError(f"{folder / 'tokenizer.json'}: no model.vocab mapping (not a tokenizers JSON file)") from None
    return max(ids) + 1


def _read_weights(folder: Path) -> Weights:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return _load_safetensors(single)
    if not index.is_file():
        raise ModelLoadError(f"{folder}: neither model.safetensors nor model.safetensors.index.json exists")
    weight_map = _read_json(folder, index.name).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index}: no 'weight_map' object")
    weights: Weights = {}
    for shard in sorted(set(weight_map.values())):
        weights.update(_load_safetensors(folder / shard))
    return weights


def _load_safetensors(path: Path) -> Weights:
    if not path.is_file():
        raise ModelLoadError(f"{path.parent}: shard {path.name} named by the index is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({err})") from None


def _read_json(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        raise ModelLoadError(f"{folder}: {name} is missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path}: malformed JSON ({err})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data
