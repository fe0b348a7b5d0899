"""Read recipe YAML into the frozen dataclasses of ``schema``, checking every field.

The reader walks the dataclass fields and their type hints, so a field added
to ``schema`` is validated without touching this file: unknown keys, missing
required keys, wrong types and broken field rules all raise ``RecipeError``
naming the file, the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ignition.recipes.rules import quote
from ignition.recipes.schema import CapacityDefaults, ModelDims, Recipe, RecipeError

BUNDLED_DIR = Path(__file__).resolve().parent
MAX_NODES = 10_000  # a recipe has about a hundred; aliases may not expand a document beyond this
FROM_CHECKPOINT = "from_checkpoint"  # `dimensions: from_checkpoint` in YAML
_LOADER_SET = {"source"}  # Recipe fields the loader fills, never the YAML


@dataclasses.dataclass(frozen=True, slots=True)
class _Where:
    """Error context: the file and the dotted path of the field being read."""

    file: Path
    field: str = ""

    def child(self, name: str) -> "_Where":
        name = name if len(name) <= 60 else quote(name, 60)  # a field name is user text too
        return _Where(self.file, f"{self.field}.{name}" if self.field else name)

    def error(self, problem: str, allowed: str = "") -> RecipeError:
        where = f"{self.file}: {self.field}" if self.field else str(self.file)
        return RecipeError(f"{where}: {problem}" + (f"; allowed: {allowed}" if allowed else ""))


def read_recipe_file(path: Path) -> Recipe:
    """Parse and validate one recipe file (no caching; see ``load_recipe``)."""
    where = _Where(path)
    data = _read_yaml(path)
    recipe = _build(Recipe, data, where, exclude=_LOADER_SET)
    recipe = dataclasses.replace(recipe, source=path, target=_anchor(recipe.target, path))
    if recipe.draft is not None:
        recipe = dataclasses.replace(recipe, draft=_anchor(recipe.draft, path))
    _check_consistency(recipe, where)
    return recipe


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; pass a recipe name or a path to a recipe .yaml file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_RecipeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{path}: not valid YAML{at}; allowed: a YAML mapping of recipe fields") from None
    except _TooLarge as exc:
        raise RecipeError(f"{path}: {exc}; allowed: a recipe whose aliases expand to at most {MAX_NODES} "
                          "values") from None
    except (RecursionError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: not a readable recipe ({exc.__class__.__name__}); "
                          "allowed: a YAML mapping of recipe fields") from None
    if not isinstance(data, dict):
        raise _Where(path).error("the document is not a mapping", "a YAML mapping of recipe fields")
    return data


class _TooLarge(ValueError):
    """A document whose aliases expand beyond ``MAX_NODES`` (a "billion laughs")."""


class _RecipeLoader(yaml.SafeLoader):
    """Safe YAML whose anchors and aliases may share values, but not multiply them without bound.

    PyYAML builds an alias as a shared reference, so a few lines of nested
    aliases load instantly; what explodes is every later walk over the value
    (validation, repr in a message). The composed document is measured with
    each alias counted in full, before any value is built.
    """

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            size = _expanded_size(node, {}, set())
            if size > MAX_NODES:
                raise _TooLarge(f"its aliases expand to more than {MAX_NODES} values")
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes in ``node`` with every alias expanded (memoized, so a bomb is measured in linear time)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise _TooLarge("an alias refers to a value that contains it")
    open_nodes.add(key)
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_NODES:
            break  # no need to count a bomb to the end
    open_nodes.discard(key)
    sizes[key] = total
    return total


def _anchor(source, recipe_file: Path):
    """Relative checkpoint paths are relative to the recipe file's folder."""
    if source.checkpoint is None or source.checkpoint.is_absolute():
        return source
    return dataclasses.replace(source, checkpoint=(recipe_file.parent / source.checkpoint).resolve())


# ---------------------------------------------------------------------------
# Generic field reading
# ---------------------------------------------------------------------------


def _build(cls: type, data: Any, where: _Where, exclude: set[str] = frozenset()) -> Any:
    if not isinstance(data, dict):
        raise where.error(f"expected a mapping, got {_kind(data)}", f"a mapping with fields {_names(cls, exclude)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in exclude}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise where.child(unknown[0]).error("unknown field", f"fields {_names(cls, exclude)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _field_value(f, hints[name], data[name], where.child(name))
        elif _required(f):
            raise where.child(name).error("missing", f.metadata.get("allowed", _type_words(hints[name])))
    return cls(**values)


def _field_value(f: dataclasses.Field, hint: Any, raw: Any, where: _Where) -> Any:
    value = _convert(hint, raw, where, f.metadata.get("allowed"))
    check = f.metadata.get("check")
    problem = check(value) if check and value is not None else None
    if problem:
        raise where.error(problem, f.metadata["allowed"])
    return value


def _convert(hint: Any, raw: Any, where: _Where, allowed: str | None) -> Any:
    optional = _optional_inner(hint)
    if optional is not None:
        if raw is None or (optional is ModelDims and raw == FROM_CHECKPOINT):
            return None
        return _convert(optional, raw, where, allowed)
    if dataclasses.is_dataclass(hint):
        return _build(hint, raw, where)
    if typing.get_origin(hint) is tuple:
        return _convert_list(typing.get_args(hint)[0], raw, where, allowed)
    return _convert_scalar(hint, raw, where, allowed)


def _convert_list(item: type, raw: Any, where: _Where, allowed: str | None) -> tuple:
    if not isinstance(raw, list):
        raise where.error(f"expected a list, got {_kind(raw)}", allowed or f"a list of {item.__name__}")
    return tuple(_convert_scalar(item, v, where, allowed) for v in raw)


def _convert_scalar(hint: type, raw: Any, where: _Where, allowed: str | None) -> Any:
    if hint is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        if not math.isfinite(raw):
            raise where.error(f"{raw} is not a finite number", allowed or "a finite number")
        return float(raw)
    if hint is Path and isinstance(raw, str):
        return Path(raw)
    if hint in (int, str, bool) and isinstance(raw, hint) and not (hint is int and isinstance(raw, bool)):
        return raw
    raise where.error(f"expected {_type_words(hint)}, got {_kind(raw)} {quote(raw)}", allowed or _type_words(hint))


def _optional_inner(hint: Any) -> Any | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _names(cls: type, exclude: set[str]) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.name not in exclude)


def _type_words(hint: Any) -> str:
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false", Path: "a path"}
    return words.get(hint, "a mapping" if dataclasses.is_dataclass(hint) else str(hint))


def _kind(raw: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "nothing"}.get(type(raw), type(raw).__name__)


# ---------------------------------------------------------------------------
# Rules that span fields
# ---------------------------------------------------------------------------


def _check_consistency(recipe: Recipe, where: _Where) -> None:
    cap = recipe.capacity
    at = where.child("capacity")
    if recipe.target.dimensions is not None:
        _check_dims(recipe, where)
    if "learned" in cap.proposal_sources and recipe.draft is None:
        raise where.child("draft").error("missing, but capacity.proposal_sources lists 'learned'",
                                         "a draft model (checkpoint) or proposal_sources without 'learned'")
    if cap.drafts and not cap.proposal_sources:
        raise at.child("proposal_sources").error(f"empty while drafts is {cap.drafts}",
                                                 "at least one of learned, copy (or drafts: 0)")
    if cap.drafts + 1 > cap.completion_token_capacity:
        raise at.child("drafts").error(
            f"{cap.drafts} drafts need width {cap.drafts + 1} > completion_token_capacity "
            f"{cap.completion_token_capacity}", f"drafts <= {cap.completion_token_capacity - 1}")
    _check_request_buckets(cap, at.child("request_buckets"))


def _check_dims(recipe: Recipe, where: _Where) -> None:
    dims = recipe.target.dimensions
    problem = dims.grouping_problem()
    if problem:
        raise where.child("target.dimensions").error(problem, "num_key_value_heads dividing num_attention_heads")
    longest = recipe.capacity.prompt_buckets[-1]
    if longest > dims.context_length:
        raise where.child("capacity.prompt_buckets").error(
            f"{longest} exceeds the model's context of {dims.context_length} tokens",
            f"prompt buckets <= {dims.context_length}")


def _check_request_buckets(cap: CapacityDefaults, where: _Where) -> None:
    padded = 1 << (cap.concurrency - 1).bit_length()
    beyond = [b for b in cap.request_buckets if b > padded]
    if beyond:
        raise where.error(f"{beyond[0]} exceeds the padded concurrency {padded}",
                          f"powers of two up to {padded} (concurrency {cap.concurrency})")


# ---------------------------------------------------------------------------
# The registry: bundled recipes, read once
# ---------------------------------------------------------------------------


@functools.cache
def bundled_recipes() -> tuple[Recipe, ...]:
    """Every recipe shipped in this package, sorted by name."""
    recipes = tuple(sorted((read_recipe_file(p) for p in BUNDLED_DIR.glob("*.yaml")), key=lambda r: r.name))
    seen: dict[str, str] = {}
    for recipe in recipes:
        for key in (recipe.name, *recipe.aliases):
            if key in seen:
                raise RecipeError(f"{recipe.source}: name {key!r} is already used by recipe {seen[key]!r}")
            seen[key] = recipe.name
    return recipes


@functools.cache
def _recipe_file(path: Path) -> Recipe:
    return read_recipe_file(path)


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A bundled recipe by name or alias, or a recipe YAML file by path (each read once)."""
    key = str(name_or_path)
    for recipe in bundled_recipes():
        if key == recipe.name or key in recipe.aliases:
            return recipe
    path = Path(key).expanduser()
    if path.suffix in (".yaml", ".yml") or path.exists():
        return _recipe_file(path.resolve())
    known = ", ".join(_label(r) for r in bundled_recipes())
    raise RecipeError(f"unknown recipe {key!r}; known recipes: {known}; or pass a path to a recipe .yaml file")


def list_recipes() -> list[Recipe]:
    return list(bundled_recipes())


def _label(recipe: Recipe) -> str:
    return f"{recipe.name} (alias {', '.join(recipe.aliases)})" if recipe.aliases else recipe.name
