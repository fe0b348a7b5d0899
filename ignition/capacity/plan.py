"""``plan_capacity``: a recipe plus options -> every program a catalog will hold.

Capture consumes this plan unchanged, so ``ignition plan`` reports exactly the
catalog that ``ignition capture`` writes (checklist C10).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from flare_contract.graphs import GraphDescriptor
from ignition.capacity.envelope import CapacityEnvelope, CapacityOptions, check_options, resolve_envelope
from ignition.capacity.mixed import mixed_shapes
from ignition.capacity.separate import decode_shapes, prefill_shapes, scored_prefill_shapes, speculative_shapes
from ignition.capacity.state import state_shapes
from ignition.recipes import Recipe


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The planned catalog: envelope, graphs in a fixed order, and the packed extent."""

    recipe: str
    envelope: CapacityEnvelope
    graphs: tuple[GraphDescriptor, ...]

    @property
    def max_packed_tokens(self) -> int:
        """Largest packed token extent of any graph (C10); sizes capture headroom."""
        return max(g.max_packed_tokens for g in self.graphs)

    def counts_by_kind(self) -> dict[str, int]:
        return dict(Counter(g.kind.value for g in self.graphs))

    def to_dict(self) -> dict:
        """The ``ignition plan --json`` document."""
        return {
            "recipe": self.recipe,
            "envelope": self.envelope.to_dict(),
            "max_packed_tokens": self.max_packed_tokens,
            "shapes": [descriptor_to_dict(g) for g in self.graphs],
        }


def plan_capacity(recipe: Recipe, options: CapacityOptions = CapacityOptions()) -> CapacityPlan:
    """Plan ``recipe``'s catalog; the recipe's dimensions must be known (``Recipe.resolve``)."""
    env = resolve_envelope(recipe, options)
    return CapacityPlan(recipe=recipe.name, envelope=env, graphs=plan_graphs(env))


def plan_graphs(env: CapacityEnvelope) -> tuple[GraphDescriptor, ...]:
    """Every graph for ``env``: prefill, scored prefill, decode, speculative, mixed, then state programs."""
    graphs = (
        prefill_shapes(env)
        + scored_prefill_shapes(env)
        + decode_shapes(env)
        + speculative_shapes(env)
        + (mixed_shapes(env) if env.mixed else ())
        + state_shapes(env)
    )
    ids = [g.id for g in graphs]
    assert len(set(ids)) == len(ids), f"graph ids must be unique: {ids}"
    return graphs


def descriptor_to_dict(g: GraphDescriptor) -> dict:
    return {
        "id": g.id,
        "kind": g.kind.value,
        "batch_capacity": g.batch_capacity,
        "proposal_depth": g.proposal_depth,
        "width": g.width,
        "aggregate": g.aggregate,
        "prefill_capacity": g.prefill_capacity,
        "ragged": g.ragged,
        "value_source": g.value_source.value if g.value_source else None,
        "proposal_source": g.proposal_source,
        "speculation_enabled": g.speculation_enabled,
        "confidence_width": g.confidence_width,
        "max_packed_tokens": g.max_packed_tokens,
        "estimated_duration_ns": g.estimated_duration_ns,
    }


def plan_recipe(
    name_or_path: str, options: CapacityOptions = CapacityOptions(), model: Path | None = None
) -> CapacityPlan:
    """``ignition plan``: load the recipe, bind ``--model`` if given, plan it."""
    from ignition.recipes import load_recipe

    recipe = load_recipe(name_or_path)
    check_options(recipe, options)  # before --model is read: a flag error needs no checkpoint
    return plan_capacity(recipe.resolve(model), options)
