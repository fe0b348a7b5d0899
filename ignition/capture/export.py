"""Export one program spec to a ``.pt2`` file and describe its call signature.

Non-strict ``torch.export`` without ``run_decompositions()``: the in-place cache
and state updates stay in place (decomposing would functionalize them into a
full-cache copy per call). ``example_inputs`` is cleared before saving, or the
file would embed the example weights and caches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from flare_contract.manifest import ArgSpec

# AOTInductor settings for every compiled program. Single-threaded generated kernels: with OpenMP regions
# (what Inductor emits when the capturing process has several torch threads), a decode step ran 4x slower
# at two threads on two shared cores than the same package without them, and 16x slower than either at one
# thread (docs/catalog-format.md, "Programs"). Matrix products still call ATen, which uses the runtime's
# --threads. Fixing it here also makes the package independent of the capturing process's thread count.
AOTI_CONFIGS = {"cpp.threads": 1}


class ProgramSpecLike(Protocol):
    """What ``ignition.models.programs.build_program`` returns (duck-typed here)."""

    module: torch.nn.Module
    example_args: Any
    input_names: Sequence[str]
    output_names: Sequence[str]


@dataclass(frozen=True, slots=True)
class ExportedProgram:
    inputs: tuple[ArgSpec, ...]
    outputs: tuple[ArgSpec, ...]
    weight_orders: Mapping[str, tuple[str, ...]]  # input name -> dict key order it was exported with
    # (weight set, key) -> True where every op of the graph that reads the weight is flare::linear taking it
    # as its weight, False where some other op reads it (weights the graph never reads are left out)
    weight_uses: Mapping[tuple[str, str], bool] = dataclasses.field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def positional_args(spec: ProgramSpecLike) -> tuple[Any, ...]:
    """The example arguments in ``input_names`` order (specs may give a dict)."""
    if isinstance(spec.example_args, Mapping):
        return tuple(spec.example_args[name] for name in spec.input_names)
    args = tuple(spec.example_args)
    if len(args) != len(spec.input_names):
        raise ValueError(f"{len(args)} example args for {len(spec.input_names)} input names")
    return args


def export_program(
    spec: ProgramSpecLike, path: Path, weight_sets: Mapping[str, frozenset[str]], compiled_path: Path | None = None
) -> ExportedProgram:
    """Export ``spec`` to ``path`` (and, given ``compiled_path``, an AOTInductor package there).

    ``weight_sets`` gives each weight set's key names: a dict input is recorded as
    the set whose keys it holds, so the runtime can rebind it from the catalog.
    Weights stay inputs of the compiled package too, so it holds no weights.
    """
    args = positional_args(spec)
    ep = torch.export.export(spec.module, args, strict=False)
    if compiled_path is not None:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(compiled_path), inductor_configs=AOTI_CONFIGS)
    # What the graph writes, plus what the builder declares (belt and braces).
    mutated = _mutated_inputs(ep, spec.input_names, args) | set(getattr(spec, "mutated_inputs", ()))
    outputs = _output_specs(ep, spec.output_names)
    ep.example_inputs = None
    torch.export.save(ep, path)
    inputs = tuple(_input_spec(name, arg, mutated, weight_sets) for name, arg in zip(spec.input_names, args))
    orders = {name: tuple(arg) for name, arg in zip(spec.input_names, args) if isinstance(arg, Mapping)}
    return ExportedProgram(inputs, outputs, orders, _weight_uses(ep, spec.input_names, args, inputs, weight_sets))


def _weight_uses(ep: torch.export.ExportedProgram, input_names: Sequence[str], args: Sequence[Any],
                 inputs: Sequence[ArgSpec], weight_sets: Mapping[str, frozenset[str]]) -> dict[tuple[str, str], bool]:
    """For each weight the graph reads, (set, key) -> whether only flare::linear reads it, as its weight."""
    leaves: list[tuple[str, str] | None] = []  # per flattened user input, in export's order: the weight it is
    for name, arg, spec in zip(input_names, args, inputs):
        if not isinstance(arg, Mapping):
            leaves += [None] * len(torch.utils._pytree.tree_leaves(arg))
            continue
        for key in arg:  # a dict flattens in its insertion order
            owner = next((s for s in spec.prefixed if key.startswith(f"{s}.") and key[len(s) + 1:] in weight_sets[s]),
                         None)
            leaves.append((owner, key[len(owner) + 1:]) if owner else (spec.weights, key))
    weights = dict(zip(ep.graph_signature.user_inputs, leaves, strict=True))
    linear = torch.ops.flare.linear.default
    uses: dict[tuple[str, str], bool] = {}
    for node in ep.graph.nodes:
        weight = weights.get(node.name) if node.op == "placeholder" else None
        if weight is None or not node.users:
            continue
        uses[weight] = all(user.op == "call_function" and user.target is linear and len(user.args) >= 2
                           and user.args[1] is node and user.args[0] is not node and node not in user.args[2:]
                           and node not in user.kwargs.values() for user in node.users)
    return uses


def _input_spec(name: str, arg: Any, mutated: set[str], weight_sets: Mapping[str, frozenset[str]]) -> ArgSpec:
    if isinstance(arg, Mapping):
        binding = weight_binding(frozenset(arg), weight_sets)
        if binding is None:
            raise ValueError(f"dict input {name!r} matches no weight set's keys, alone or followed by other "
                             f"sets' keys prefixed '<set>.' ({sorted(weight_sets)})")
        return ArgSpec(name=name, weights=binding[0], prefixed=binding[1])
    if not isinstance(arg, torch.Tensor):
        raise ValueError(f"input {name!r} is a {type(arg).__name__}; programs take tensors or weight dicts")
    return ArgSpec(name, tuple(arg.shape), dtype_name(arg.dtype), mutated=name in mutated)


def weight_binding(keys: frozenset[str], weight_sets: Mapping[str, frozenset[str]]) -> tuple[str, tuple[str, ...]] | None:
    """(primary set, prefixed sets) whose keys make up ``keys``: a program running the draft
    takes the target's keys plus the draft's as ``draft.<key>`` (program contract v2)."""
    for primary, primary_keys in weight_sets.items():
        rest = keys - primary_keys
        prefixed = tuple(s for s in weight_sets if s != primary and any(k.startswith(f"{s}.") for k in rest))
        expected = primary_keys.union(*({f"{s}.{k}" for k in weight_sets[s]} for s in prefixed))
        if expected == keys:
            return primary, prefixed
    return None


def _leaf_owners(input_names: Sequence[str], args: Sequence[Any]) -> list[str]:
    """The top-level input each flattened leaf belongs to, in export's flattening order."""
    owners: list[str] = []
    for name, arg in zip(input_names, args):
        owners += [name] * len(torch.utils._pytree.tree_leaves(arg))
    return owners


def _mutated_inputs(ep: torch.export.ExportedProgram, input_names: Sequence[str], args: Sequence[Any]) -> set[str]:
    """Inputs written in place by some op in the graph (schema alias info marks writes)."""
    owners = dict(zip(ep.graph_signature.user_inputs, _leaf_owners(input_names, args), strict=True))
    written: set[str] = set()
    for node in ep.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written |= {_base(n).name for n in _nodes_in(value)}
    return {owners[name] for name in written if name in owners}


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """Follow views (select, slice, view...) back to the tensor they alias."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        schema = getattr(node.target, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or first.alias_info.is_write:
            break
        node = node.args[0]
    return node


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.fx.Node)]


def _output_specs(ep: torch.export.ExportedProgram, output_names: Sequence[str]) -> tuple[ArgSpec, ...]:
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    user = set(ep.graph_signature.user_outputs)
    values = [n for n in _nodes_in(output_node.args[0]) if n.name in user]
    if len(values) != len(output_names):
        raise ValueError(f"program returns {len(values)} outputs but names {len(output_names)}: {list(output_names)}")
    return tuple(
        ArgSpec(name, tuple(int(d) for d in node.meta["val"].shape), dtype_name(node.meta["val"].dtype))
        for name, node in zip(output_names, values)
    )
