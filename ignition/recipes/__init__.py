"""Recipes: YAML model-family descriptions, validated into frozen dataclasses.

Public API: ``load_recipe(name_or_path)``, ``list_recipes()``, ``RecipeError``,
and the types ``Recipe``, ``ModelDims``, ``ModelSource``, ``CapacityDefaults``.
"""

from ignition.recipes.checkpoint import read_model_dims
from ignition.recipes.loader import list_recipes, load_recipe, read_recipe_file
from ignition.recipes.schema import CapacityDefaults, ModelDims, ModelSource, Recipe, RecipeError

__all__ = [
    "CapacityDefaults",
    "ModelDims",
    "ModelSource",
    "Recipe",
    "RecipeError",
    "list_recipes",
    "load_recipe",
    "read_model_dims",
    "read_recipe_file",
]
