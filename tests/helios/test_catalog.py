"""helios.catalog.load: load and validate a captured catalog (issue 2 item 8; C1, C11)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from flare_contract.manifest import FORMAT_VERSION, CatalogError, descriptor_from_dict, descriptor_to_dict
from helios.catalog.load import load
from ignition.capture import write_catalog
from ignition.capture.stand_in import (HIDDEN, StandInProgram, stand_in_inputs, stand_in_source, stand_in_state,
                                       stand_in_weights)
from numerics import assert_choices_match, assert_close_paths, chain_tolerance

REPO = Path(__file__).resolve().parents[2]
# tanh(embed @ proj) then hidden @ embed.T: two dependent reductions over the hidden width.
STAND_IN_TOLERANCE = chain_tolerance(torch.float32, [HIDDEN, HIDDEN])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pristine")
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text('{"model": "stand-in"}')
    write_catalog(stand_in_source(tokenizer), folder / "catalog")
    return folder / "catalog"


@pytest.fixture
def catalog_dir(pristine, tmp_path) -> Path:
    """A private copy each test may damage."""
    return Path(shutil.copytree(pristine, tmp_path / "catalog"))


def edit_manifest(root: Path, **changes) -> None:
    raw = yaml.safe_load((root / "catalog.yaml").read_text())
    raw.update(changes)
    (root / "catalog.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.mark.numerics
def test_loaded_program_equals_eager_and_updates_state_in_place(catalog_dir):
    catalog = load(catalog_dir)
    for descriptor in catalog.descriptors:
        inputs = stand_in_inputs(descriptor)
        loaded_state, eager_state = stand_in_state(), stand_in_state()
        for state in (loaded_state, eager_state):
            state["pending"].copy_(torch.tensor([3, 5, 7, 9]))
            state["seq_lens"].copy_(torch.tensor([0, 2, 4, 6], dtype=torch.int32))
        got = catalog.program(descriptor.id)(**inputs, **loaded_state)
        want = StandInProgram(descriptor.prefill_capacity)(stand_in_weights(), **inputs, **eager_state)
        # The exported graph may run other kernels than eager (another CPU, a decomposed op):
        # floats within the two stages' reordering bound, the greedy choice exact up to near-ties.
        assert_close_paths(got["logits"], want[1], STAND_IN_TOLERANCE, f"{descriptor.id} logits")
        assert_choices_match(got["tokens"], want[0], want[1], STAND_IN_TOLERANCE, f"{descriptor.id} tokens")
        assert torch.equal(loaded_state["pending"][: len(got["tokens"])], got["tokens"]), "pending = own tokens"
        assert_close_paths(loaded_state["cache"], eager_state["cache"], STAND_IN_TOLERANCE, f"{descriptor.id} cache")
        assert torch.equal(loaded_state["seq_lens"], eager_state["seq_lens"]), f"{descriptor.id}: seq_lens"
        assert loaded_state["cache"].abs().sum() > 0, "the program must write the caller's cache in place"


def test_C11_estimated_duration_is_zero_even_when_the_file_says_otherwise(catalog_dir):
    raw = yaml.safe_load((catalog_dir / "catalog.yaml").read_text())
    for program in raw["programs"]:
        program["estimated_duration_ns"] = 123_456
    (catalog_dir / "catalog.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    catalog = load(catalog_dir)
    assert catalog.descriptors and all(d.estimated_duration_ns == 0 for d in catalog.descriptors)


def test_C1_descriptors_keep_their_kinds_and_capacities(catalog_dir):
    by_id = {d.id: d for d in load(catalog_dir).descriptors}
    assert by_id["prefill_p8"].kind.value == "prefill" and by_id["prefill_p8"].prefill_capacity == 8
    assert by_id["decode_b4"].kind.value == "decode" and by_id["decode_b4"].batch_capacity == 4


@settings(max_examples=25 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 200, deadline=None)
@given(
    kind=st.sampled_from(list(GraphKind)),
    batch=st.integers(1, 64),
    depth=st.integers(0, 8),
    width=st.integers(1, 9),
    prompt=st.integers(0, 64).map(lambda n: 64 * n),
    ragged=st.booleans(),
    source=st.sampled_from([None, *ValueSource]),
    proposals=st.sampled_from([None, "learned", "copy"]),
    speculation=st.booleans(),
    duration=st.integers(0, 10**12),
)
def test_C11_descriptors_round_trip_through_the_manifest_with_unknown_durations(
    kind, batch, depth, width, prompt, ragged, source, proposals, speculation, duration
):
    aggregate = batch * width - (1 if ragged and batch * width > 1 else 0)
    desc = GraphDescriptor(f"g_{kind.value}", kind, batch, depth, width, aggregate, prompt, ragged, source,
                           proposals, speculation, depth if speculation else 0, duration)
    raw = yaml.safe_load(yaml.safe_dump(descriptor_to_dict(desc)))
    assert raw["estimated_duration_ns"] == 0
    assert descriptor_from_dict(raw) == dataclasses.replace(desc, estimated_duration_ns=0)
    raw["estimated_duration_ns"] = duration
    assert descriptor_from_dict(raw).estimated_duration_ns == 0


def test_other_format_version_is_refused_naming_both_versions(catalog_dir):
    edit_manifest(catalog_dir, format_version=FORMAT_VERSION + 1)
    with pytest.raises(CatalogError, match=rf"version {FORMAT_VERSION + 1}.*version {FORMAT_VERSION}"):
        load(catalog_dir)


def test_other_torch_release_is_refused_naming_both(catalog_dir):
    edit_manifest(catalog_dir, torch_version="2.9.1+cpu")
    with pytest.raises(CatalogError, match=r"torch 2\.9\.1\+cpu.*torch 2\.13\.0"):
        load(catalog_dir)


def test_same_torch_release_with_another_build_tag_loads(catalog_dir):
    edit_manifest(catalog_dir, torch_version="2.13.0+cu128")
    assert load(catalog_dir).descriptors


def test_truncated_program_is_refused_naming_the_file(catalog_dir):
    program = catalog_dir / "programs" / "decode_b4.pt2"
    program.write_bytes(program.read_bytes()[:1000])
    with pytest.raises(CatalogError, match=r"decode_b4\.pt2.*truncated or modified"):
        load(catalog_dir)


def test_modified_weights_are_refused_naming_the_file(catalog_dir):
    weights = catalog_dir / "weights" / "target.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CatalogError, match=r"target\.safetensors"):
        load(catalog_dir)


def test_skipping_hash_checks_still_requires_every_file(catalog_dir):
    program = catalog_dir / "programs" / "decode_b4.pt2"
    program.write_bytes(program.read_bytes() + b"\0")
    assert load(catalog_dir, verify_hashes=False).descriptors
    with pytest.raises(CatalogError, match="decode_b4"):
        load(catalog_dir)
    program.unlink()
    with pytest.raises(CatalogError, match=r"decode_b4\.pt2: missing"):
        load(catalog_dir, verify_hashes=False)


def test_missing_tokenizer_file_is_refused(catalog_dir):
    (catalog_dir / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CatalogError, match=r"tokenizer\.json: missing"):
        load(catalog_dir)


def test_folder_without_manifest_is_not_a_catalog(tmp_path):
    with pytest.raises(CatalogError, match="not a catalog"):
        load(tmp_path)


def test_malformed_manifest_is_refused(catalog_dir):
    (catalog_dir / "catalog.yaml").write_text("format_version: 1\nprograms: [\n")
    with pytest.raises(CatalogError, match="not valid YAML"):
        load(catalog_dir)


def test_a_program_taking_an_unknown_weight_set_is_refused(catalog_dir):
    raw = yaml.safe_load((catalog_dir / "catalog.yaml").read_text())
    raw["programs"][1]["inputs"][0]["weights"] = "draft"
    (catalog_dir / "catalog.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(CatalogError, match="decode_b1 input 'weights' takes weight set 'draft'"):
        load(catalog_dir)


def test_programs_materialize_once_and_bind_by_name(catalog_dir):
    catalog = load(catalog_dir)
    program = catalog.program("decode_b1")
    assert catalog.program("decode_b1") is program
    args = program.bind({**stand_in_state(), **stand_in_inputs(program.entry.descriptor)})
    assert [type(a) for a in args][0] is dict and list(args[0]) == ["embed", "proj"]
    with pytest.raises(CatalogError, match="unknown inputs"):
        program.bind({"bogus": torch.zeros(1)})
    with pytest.raises(CatalogError, match="no program 'decode_b8'"):
        catalog.program("decode_b8")


def test_an_exported_program_checks_its_first_call_fully_and_every_call_against_the_manifest(catalog_dir):
    """torch.export's per-call input check (a Python pre-hook, most of a state program's time) runs on the first
    call only; from then on ``bind`` compares every passed input with the manifest, on every call."""
    catalog = load(catalog_dir)
    program = catalog.program("decode_b1")
    state = catalog.allocate_state()
    good = stand_in_inputs(program.entry.descriptor)
    assert program.module.validate_inputs is True
    program(**good, **state)
    assert program.module.validate_inputs is False  # the first call checked the export against these shapes
    name, value = next((n, v) for n, v in good.items() if v.dim() > 0)
    for wrong in (torch.zeros((value.shape[0] + 1, *value.shape[1:]), dtype=value.dtype),
                  torch.zeros(value.shape, dtype=torch.float64 if value.dtype != torch.float64 else torch.float32)):
        with pytest.raises(CatalogError, match=f"decode_b1: input {name} is .* but the manifest records"):
            program(**{**good, name: wrong}, **state)
    program(**good, **state)  # a refused call changed nothing: the program still runs


def test_state_spec_allocates_the_recorded_state(catalog_dir):
    state = load(catalog_dir).allocate_state()
    assert set(state) == {"pending", "seq_lens", "cache"}
    assert state["seq_lens"].dtype == torch.int32 and state["cache"].shape == (4, 32, 8)


def test_a_fresh_process_loads_and_runs_without_importing_ignition(catalog_dir):
    script = textwrap.dedent(
        f"""
        import sys, torch
        from helios.catalog.load import load
        catalog = load({str(catalog_dir)!r})
        state = catalog.allocate_state()
        slots = torch.tensor([1], dtype=torch.int32)
        out = catalog.program("prefill_p8")(prompt_tokens=torch.arange(8), row_slots=slots, **state)
        assert int(state["seq_lens"][1]) == 8, state["seq_lens"]
        assert not [m for m in sys.modules if m.startswith("ignition")], "runtime imported ignition"
        print("ok", out["tokens"].tolist())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok")


@pytest.mark.parametrize("old", [2, 3])
def test_older_catalog_is_refused_with_one_line_saying_to_recapture(catalog_dir, old):
    """Program contract version 4 (state programs and the checkpoint store) cannot run older catalogs."""
    edit_manifest(catalog_dir, format_version=old)
    with pytest.raises(CatalogError, match=rf"format version {old} but this Flare reads version 4.*recapture") as error:
        load(catalog_dir)
    assert "\n" not in str(error.value)


def test_a_program_running_the_draft_gets_target_then_prefixed_draft_weights(tmp_path):
    """A weights input recorded as target + prefixed draft is rebuilt from the two stored sets, in order."""
    from ignition.capture.stand_in import build_stand_in

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": "stand-in"}')
    target, draft = stand_in_weights(0), stand_in_weights(1)
    combined = {**target, **{f"draft.{k}": t for k, t in draft.items()}}
    source = dataclasses.replace(
        stand_in_source(tokenizer), weights={"target": target, "draft": draft},
        build=lambda desc: build_stand_in(desc, combined if desc.kind is GraphKind.DECODE else target),
    )
    catalog = load(write_catalog(source, tmp_path / "catalog").path)
    decode, prefill = catalog.entry("decode_b1").inputs[0], catalog.entry("prefill_p8").inputs[0]
    assert (decode.weights, decode.prefixed) == ("target", ("draft",))
    assert (prefill.weights, prefill.prefixed) == ("target", ())
    program = catalog.program("decode_b1")
    bound = program.bind({**stand_in_state(), **stand_in_inputs(program.entry.descriptor)})[0]
    assert list(bound) == ["embed", "proj", "draft.embed", "draft.proj"]
    assert torch.equal(bound["draft.proj"], draft["proj"]) and torch.equal(bound["proj"], target["proj"])


def test_memoized_schema_type_hints_deserialize_the_same_program(catalog_dir):
    """Loading resolves torch's export schema annotations once per class (helios.catalog.load): the program
    it deserializes must be the one plain torch.export.load gives, graph and signature alike."""
    import typing

    from torch._export.serde import serialize

    from helios.catalog import load as catalog_module

    path = catalog_dir / load(catalog_dir).entry("decode_b4").file
    saved = serialize.typing
    try:
        serialize.typing = typing
        plain = torch.export.load(path)
        catalog_module._memoize_schema_type_hints()
        assert isinstance(serialize.typing, catalog_module._SchemaTypeHints)
        memoized = torch.export.load(path)
        assert serialize.typing._hints, "the deserializer never asked for schema hints: nothing was memoized"
    finally:
        serialize.typing = saved
    assert memoized.graph_module.code == plain.graph_module.code
    assert str(memoized.graph_signature) == str(plain.graph_signature)


class _PackageLoader:
    """Stands in for an AOTInductor package's native loader: it takes the flat input list the package's
    wrapper builds (the compiled code's order), rebuilds the arguments from the call spec and runs the
    exported program on them, so inputs in the wrong order give wrong results or fail."""

    def __init__(self, module, in_spec, out_spec) -> None:
        from torch.utils import _pytree as pytree

        self._module, self._in_spec, self._out_spec = module, in_spec, out_spec
        self._spec_text = (pytree.treespec_dumps(in_spec), pytree.treespec_dumps(out_spec))
        self.calls: list[list] = []

    def get_call_spec(self):
        return self._spec_text

    def boxed_run(self, flat):
        from torch.utils import _pytree as pytree

        self.calls.append(list(flat))
        args, kwargs = pytree.tree_unflatten(list(flat), self._in_spec)
        flat.clear()  # the native loader consumes its input list
        return pytree.tree_leaves(self._module(*args, **kwargs))


def _as_package(catalog, program_id):
    """``program_id`` as a CatalogProgram whose module is an ``AOTICompiledModel`` over ``_PackageLoader``."""
    from torch.export.pt2_archive._package import AOTICompiledModel
    from torch.utils import _pytree as pytree

    from helios.catalog.load import CatalogProgram

    exported = catalog.exported_program(program_id)
    named = {**stand_in_state(), **stand_in_inputs(exported.entry.descriptor)}
    args = exported.bind(named)
    in_spec = pytree.tree_flatten((args, {}))[1]
    out_spec = pytree.tree_flatten(exported.module(*args))[1]
    loader = _PackageLoader(exported.module, in_spec, out_spec)
    state_names = frozenset(t.name for t in catalog.state.tensors)
    return CatalogProgram(exported.entry, AOTICompiledModel(loader), catalog.program_weights, state_names), loader


def test_a_compiled_program_gets_the_flat_inputs_its_own_wrapper_builds(catalog_dir):
    """CatalogProgram calls an AOTInductor package's loader directly (helios.catalog.load._FlatCall): the same
    tensors in the same order as the package's own ``__call__`` passes, so the same outputs and state."""
    catalog = load(catalog_dir)
    for descriptor in catalog.descriptors:
        program, loader = _as_package(catalog, descriptor.id)
        inputs = stand_in_inputs(descriptor)
        direct_state, wrapped_state = stand_in_state(), stand_in_state()
        for state in (direct_state, wrapped_state):
            state["pending"].copy_(torch.tensor([3, 5, 7, 9]))
            state["seq_lens"].copy_(torch.tensor([0, 2, 4, 6], dtype=torch.int32))
        got = program(**inputs, **direct_state)
        assert program._flat, f"{descriptor.id}: the direct call was not taken"
        direct = loader.calls[-1]
        result = program.module(*program.bind({**inputs, **wrapped_state}))  # the package's own wrapper
        wrapped = loader.calls[-1]
        assert len(direct) == len(wrapped) and all(type(a) is type(b) for a, b in zip(direct, wrapped))
        # position by position: the same weight tensor, or the same named input of each call
        own = {id(t): name for name, t in {**inputs, **direct_state}.items()}
        twins = {**inputs, **wrapped_state}
        for i, (a, b) in enumerate(zip(direct, wrapped)):
            expected = twins[own[id(a)]] if id(a) in own else a
            assert b is expected, f"{descriptor.id}: flat input {i} differs from the wrapper's"
        for name, value in dict(zip((o.name for o in program.entry.outputs), result)).items():
            assert torch.equal(got[name], value), f"{descriptor.id}: {name} differs from the wrapper's call"
        for name, value in wrapped_state.items():
            assert torch.equal(direct_state[name], value), f"{descriptor.id}: state {name} differs"


def test_a_compiled_program_leaves_what_its_layout_does_not_cover_to_the_ordinary_path(catalog_dir):
    """A weights input passed by the caller is used; unknown and missing names are refused by name."""
    catalog = load(catalog_dir)
    program, loader = _as_package(catalog, "decode_b1")
    named = {**stand_in_state(), **stand_in_inputs(program.entry.descriptor)}
    weights_input = next(spec.name for spec in program.entry.inputs if spec.weights is not None)
    zeroed = {key: torch.zeros_like(t) for key, t in catalog.program_weights(
        next(spec for spec in program.entry.inputs if spec.weights is not None)).items()}
    program(**named, **{weights_input: zeroed})
    assert any(t is zeroed[key] for t in loader.calls[-1] for key in zeroed), "the caller's weights were not used"
    with pytest.raises(CatalogError, match="unknown inputs"):
        program(**named, bogus=torch.zeros(1))
    missing = dict(named)
    missing.pop(next(spec.name for spec in program.entry.inputs if spec.weights is None and spec.name in missing))
    with pytest.raises(CatalogError, match="missing input"):
        program(**missing)


def test_weights_are_loaded_on_64_byte_boundaries_with_the_files_values(catalog_dir):
    # safetensors packs tensors back to back (8-byte alignment), so a mapped file's tensors mostly start
    # mid-line; the vector kernels would then split every load in two. The loader hands out aligned ones.
    from safetensors.torch import load_file

    catalog = load(catalog_dir)
    for weight_set in catalog.manifest.weights:
        raw = load_file(catalog_dir / weight_set.file)
        assert any(t.data_ptr() % 64 for t in raw.values()), "precondition: the file maps some tensor mid-line"
        loaded = catalog.weights[weight_set.name]
        for key in weight_set.keys:
            assert loaded[key].data_ptr() % 64 == 0, f"{weight_set.name}.{key} is not 64-byte aligned"
            assert torch.equal(loaded[key], raw[key]), f"{weight_set.name}.{key} changed in the copy"


def test_capture_records_the_weights_only_flare_linear_reads(catalog):
    """linear_keys come from the exported graphs: every projection of both models (read by flare::linear
    alone), and not the tied embedding, which the embedding lookup reads beside the head's product."""
    assert [w.name for w in catalog.manifest.weights] == ["target", "draft"]
    for weight_set in catalog.manifest.weights:
        projections = tuple(k for k in weight_set.keys if k.endswith("_proj.weight") or k == "lm_head.weight")
        assert len(projections) >= 7 and weight_set.linear_keys == projections, weight_set.name
        assert "model.embed_tokens.weight" not in weight_set.linear_keys
        assert "lm_head.weight" not in weight_set.keys  # tied: the head's product reads the embedding


def _packs() -> bool:
    from helios.ops import kernels

    return kernels.active() == "native" and kernels.packs_linear_weights()


@pytest.mark.skipif(not _packs(), reason="packed weights are the native AVX-512 kernel's")
def test_packing_lays_out_exactly_the_linear_keys_once(catalog, monkeypatch):
    """Catalog.pack_linear_weights packs each set's linear_keys and nothing else, hands programs the packed
    tensors, changes nothing a second time, and packs nothing under FLARE_LINEAR_PACK=0."""
    fresh = load(catalog.path)
    monkeypatch.setenv("FLARE_LINEAR_PACK", "0")
    assert fresh.pack_linear_weights() == 0
    assert not any(torch.ops.flare.linear_weight_packed(t) for ts in fresh.weights.values() for t in ts.values())
    monkeypatch.delenv("FLARE_LINEAR_PACK")
    before = {name: dict(ts) for name, ts in fresh.weights.items()}
    expected = sum(len(w.linear_keys) for w in fresh.manifest.weights)
    assert fresh.pack_linear_weights() == expected
    for weight_set in fresh.manifest.weights:
        for key, tensor in fresh.weights[weight_set.name].items():
            packed = key in weight_set.linear_keys
            assert bool(torch.ops.flare.linear_weight_packed(tensor)) == packed, key
            assert tensor.shape == before[weight_set.name][key].shape
            if not packed:  # moved beside the packed ones (flare::gather_weights), values unchanged
                assert torch.equal(tensor, before[weight_set.name][key]), key
    spec = next(a for a in fresh.entry("decode_b1").inputs if a.weights is not None)
    bound = fresh.program_weights(spec)
    assert all(bound[k] is fresh.weights["target"][k] for k in fresh.manifest.weights[0].linear_keys)
    again = {name: dict(ts) for name, ts in fresh.weights.items()}
    assert fresh.pack_linear_weights() == expected
    assert all(fresh.weights[n][k] is t for n, ts in again.items() for k, t in ts.items())
