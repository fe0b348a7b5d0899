"""Read a Hugging Face checkpoint folder's config.json into ``ModelDims``.

Only the config is read here (no weights, no torch), so ``ignition plan`` can
size a catalog for a checkpoint it will never load.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ignition.recipes.schema import ARCHITECTURES, ModelDims, RecipeError
from ignition.recipes.rules import quote

_OPTIONAL_KEYS = {"tie_word_embeddings", "head_dim"}


def read_model_dims(folder: Path) -> ModelDims:
    """The dimensions a Qwen3 dense checkpoint's config.json declares."""
    path = Path(folder) / "config.json"
    config = _read_config(folder)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise RecipeError(f"{path}: model_type {quote(model_type)} is not supported; "
                          f"allowed: {', '.join(ARCHITECTURES)} (a dense Qwen3 checkpoint)")
    values = {f.name: _value(_lift_rope_theta(config), f, folder) for f in dataclasses.fields(ModelDims)}
    for f in dataclasses.fields(ModelDims):
        problem = values[f.name] is not None and f.metadata.get("check", lambda v: None)(values[f.name])
        if problem:
            raise RecipeError(f"{path}: {f.name}: {problem}; allowed: {f.metadata['allowed']}")
    dims = ModelDims(**_fill_implicit(values))
    if dims.grouping_problem():
        raise RecipeError(f"{path}: {dims.grouping_problem()}")
    return dims


def _lift_rope_theta(config: dict[str, Any]) -> dict[str, Any]:
    """Newer transformers nest rope_theta under rope_parameters."""
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        return config | {"rope_theta": rope["rope_theta"]}
    return config


def _fill_implicit(values: dict[str, Any]) -> dict[str, Any]:
    """Keys older configs may leave out, with the meaning transformers gives them."""
    head_dim = values["head_dim"] or values["hidden_size"] // values["num_attention_heads"]
    return values | {"head_dim": head_dim, "tie_word_embeddings": bool(values["tie_word_embeddings"])}


def require_agreement(recipe: str, declared: ModelDims, found: ModelDims, folder: Path) -> None:
    """A checkpoint given for a recipe with declared dimensions must match them."""
    for f in dataclasses.fields(ModelDims):
        want, got = getattr(declared, f.name), getattr(found, f.name)
        if want != got:
            raise RecipeError(
                f"{folder / 'config.json'}: {f.name} is {quote(got)} but recipe {recipe!r} declares {want!r}; "
                "use a checkpoint of that shape, or the 'qwen3' recipe for any Qwen3 checkpoint"
            )


def _read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise RecipeError(f"checkpoint folder {folder} does not exist; allowed: a local Hugging Face folder "
                          "with config.json, *.safetensors and tokenizer.json")
    if not path.is_file():
        raise RecipeError(f"{folder}: no config.json; allowed: a Hugging Face checkpoint folder with config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: not valid JSON ({exc.__class__.__name__}: {exc})".replace("\n", " ")) from None
    if not isinstance(config, dict):
        raise RecipeError(f"{path}: expected a JSON object of model settings")
    return config


def _value(config: dict[str, Any], f: dataclasses.Field, folder: Path) -> Any:
    if f.name not in config:
        if f.name in _OPTIONAL_KEYS:
            return None
        raise RecipeError(f"{folder / 'config.json'}: missing {f.name!r}; allowed: a Qwen3 config that sets it")
    raw = config[f.name]
    want = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool}[f.type]
    ok = isinstance(raw, bool) if want is bool else isinstance(raw, (int, float) if want is float else int)
    if not ok or (want is not bool and isinstance(raw, bool)):
        raise RecipeError(f"{folder / 'config.json'}: {f.name} is {quote(raw)}; allowed: {want.__name__}")
    return float(raw) if want is float else raw
