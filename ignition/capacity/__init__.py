"""Capacity planning: pure bucket math from a recipe to the catalog's graph descriptors.

Public API: ``CapacityOptions``, ``plan_capacity(recipe, options) -> CapacityPlan``,
``mixed_shapes(envelope)``, ``CapacityEnvelope``, ``CapacityError``.
"""

from ignition.capacity.buckets import balanced_prompt_bucket, padded, request_buckets_through
from ignition.capacity.envelope import (
    CapacityEnvelope,
    CapacityError,
    CapacityOptions,
    check_options,
    default_token_capacity,
    resolve_envelope,
)
from ignition.capacity.mixed import mixed_contract_problem, mixed_shapes
from ignition.capacity.plan import CapacityPlan, descriptor_to_dict, plan_capacity, plan_graphs, plan_recipe
from ignition.capacity.separate import speculative_shapes

__all__ = [
    "CapacityEnvelope",
    "CapacityError",
    "CapacityOptions",
    "CapacityPlan",
    "check_options",
    "balanced_prompt_bucket",
    "default_token_capacity",
    "descriptor_to_dict",
    "mixed_contract_problem",
    "mixed_shapes",
    "padded",
    "plan_capacity",
    "plan_graphs",
    "plan_recipe",
    "request_buckets_through",
    "resolve_envelope",
    "speculative_shapes",
]
