"""Untrusted catalogs: a program archive that could run code is refused unless the user trusts it (issue 17, part 3).

The manifest's hashes live in the same folder as the programs, so a rewritten
catalog passes them; what protects ``flare run`` is inspecting each archive
before torch reads it. Every archive here is a real ``torch.export.save``
output with one entry rewritten the way an attacker would.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flare_contract.manifest import CatalogError, file_sha256
from helios import launch
from helios.catalog.load import load
from helios.cli import app as flare_app
from helios.catalog.archive import archive_problem
from ignition.capture import write_catalog
from ignition.capture.stand_in import stand_in_inputs, stand_in_source, stand_in_state
from ignition.cli import app as ignition_app

runner = CliRunner()


class _Marker:
    """Unpickling this creates a file: proof that the archive's code ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def records(archive: Path) -> dict[str, bytes]:
    reader = torch._C.PyTorchFileReader(str(archive))
    return {name: reader.get_record(name) for name in reader.get_all_records()}


def rewrite(archive: Path, out: Path, changes: dict[str, bytes | None]) -> Path:
    """``archive`` with some entries replaced (None drops one), written to ``out`` under the same top folder."""
    entries = {**records(archive), **changes}
    with zipfile.ZipFile(out, "w") as zipped:
        for name, data in entries.items():
            if data is not None:
                zipped.writestr(f"{archive.stem}/{name}", data)
    return out


def pickled_weight(archive: Path, out: Path, payload) -> Path:
    """What torch.export.save writes for a tensor subclass: a weight marked use_pickle."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    config = {"config": {"extra": {"path_name": "weight_0", "is_param": False, "use_pickle": True,
                                   "tensor_meta": None}}}
    return rewrite(archive, out, {"data/weights/model_weights_config.json": json.dumps(config).encode(),
                                  "data/weights/weight_0": buffer.getvalue()})


def graph_edit(archive: Path, out: Path, change) -> Path:
    program = json.loads(records(archive)["models/model.json"])
    change(program)
    return rewrite(archive, out, {"models/model.json": json.dumps(program).encode()})


def install(root: Path, program_id: str, archive: Path) -> None:
    """Put ``archive`` in the catalog as ``program_id`` and fix the manifest's hash, as an attacker would."""
    target = root / "programs" / f"{program_id}.pt2"
    target.unlink()
    shutil.copyfile(archive, target)
    raw = yaml.safe_load((root / "catalog.yaml").read_text())
    next(p for p in raw["programs"] if p["id"] == program_id)["sha256"] = file_sha256(target)
    (root / "catalog.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trust")
    (folder / "tokenizer.json").write_text("{}")
    return write_catalog(stand_in_source(folder / "tokenizer.json"), folder / "catalog").path


@pytest.fixture
def stand_in_copy(stand_in, tmp_path) -> Path:
    return Path(shutil.copytree(stand_in, tmp_path / "catalog"))


@pytest.fixture
def tiny_copy(catalog, tmp_path) -> Path:
    """The session catalog with hard-linked programs and weights (replaced, never written through)."""
    root = tmp_path / "tiny"
    shutil.copytree(catalog.path, root, copy_function=os.link)
    (root / "catalog.yaml").unlink()
    shutil.copyfile(catalog.path / "catalog.yaml", root / "catalog.yaml")
    return root


# -- the archive inspection -----------------------------------------------------------------------


def test_a_pickled_weight_is_refused_before_torch_unpickles_it(stand_in_copy, tmp_path):
    marker = tmp_path / "ran"
    install(stand_in_copy, "decode_b1", pickled_weight(stand_in_copy / "programs/decode_b1.pt2", tmp_path / "p.pt2",
                                                       _Marker(marker)))
    catalog = load(stand_in_copy)  # the rewritten hash passes: hashes prove nothing against the folder's author
    with pytest.raises(CatalogError, match=r"decode_b1\.pt2: program decode_b1 data/weights/extra: is pickled") as error:
        catalog.program("decode_b1")
    assert "--trust-catalog" in str(error.value) and "\n" not in str(error.value)
    assert not marker.exists(), "the archive's code ran"


def test_with_trust_the_same_archive_reaches_torch(stand_in_copy, tmp_path):
    """The refusal above is what stood between the archive and running its code."""
    marker = tmp_path / "ran"
    install(stand_in_copy, "decode_b1", pickled_weight(stand_in_copy / "programs/decode_b1.pt2", tmp_path / "p.pt2",
                                                       _Marker(marker)))
    load(stand_in_copy, trust=True).program("decode_b1")  # torch unpickles the extra weight and ignores it
    assert marker.exists()


def test_a_trusted_catalog_with_a_pickled_tensor_loads_and_runs(stand_in_copy, tmp_path):
    install(stand_in_copy, "decode_b1", pickled_weight(stand_in_copy / "programs/decode_b1.pt2", tmp_path / "p.pt2",
                                                       torch.zeros(2)))
    with pytest.raises(CatalogError, match="is pickled"):
        load(stand_in_copy).check_programs()
    catalog = load(stand_in_copy, trust=True)
    catalog.check_programs()
    program = catalog.program("decode_b1")
    out = program(**stand_in_inputs(program.entry.descriptor), **stand_in_state())
    assert out["tokens"].shape[0] == 1


@pytest.mark.parametrize("name, change, complaint", [
    ("pickled example inputs", lambda a, out: rewrite(a, out, {"data/sample_inputs/model.pt": b"\x80\x04K\x01."}),
     "carries pickled example inputs"),
    ("AOTInductor code", lambda a, out: rewrite(a, out, {"data/aotinductor/model/model.so": b"\x7fELF"}),
     "holds AOTInductor native code"),
    ("legacy pickled weights", lambda a, out: rewrite(a, out, {"data/weights/model.pt": b"\x80\x04K\x01."}),
     "holds a pickled entry"),
    ("guard code", lambda a, out: graph_edit(a, out, lambda p: p.update(guards_code=["__import__('os')"])),
     "carries guard code"),
    ("a sympy expression", lambda a, out: graph_edit(
        a, out, lambda p: p["graph_module"]["graph"]["nodes"][0].update(extra={"expr_str": "__import__('os')"})),
     "symbolic shape expressions"),
    ("a node calling a library loader", lambda a, out: graph_edit(
        a, out, lambda p: p["graph_module"]["graph"]["nodes"][0].update(target="torch.ops.load_library")),
     "calls 'torch.ops.load_library', which is not an operator of aten or flare"),
    ("a node calling os.system", lambda a, out: graph_edit(
        a, out, lambda p: p["graph_module"]["graph"]["nodes"][0].update(target="torch.serialization.os.system")),
     "calls 'torch.serialization.os.system'"),
    ("a constant that is an object", lambda a, out: rewrite(a, out, {
        "data/constants/model_constants_config.json": json.dumps({"config": {"c": {
            "path_name": "custom_obj_0", "is_param": False, "use_pickle": False, "tensor_meta": None}}}).encode(),
        "data/constants/custom_obj_0": b"x"}), "is not a raw tensor"),
    ("the legacy layout", lambda a, out: _legacy(out), "no top folder"),
])
def test_archives_that_could_run_code_are_named(stand_in, tmp_path, name, change, complaint):
    archive = change(stand_in / "programs" / "decode_b1.pt2", tmp_path / "decode_b1.pt2")
    problem = archive_problem(archive)
    assert problem is not None and complaint in problem, problem


def _legacy(out: Path) -> Path:
    with zipfile.ZipFile(out, "w") as zipped:
        zipped.writestr("version", "8.20")
        zipped.writestr("serialized_state_dict.pt", b"\x80\x04K\x01.")
    return out


def test_every_program_a_capture_writes_loads_without_trust(catalog, stand_in):
    """Captures write no pickled entry: weights are inputs and example inputs are cleared before saving."""
    for root in (catalog.path, stand_in):
        for program in sorted((root / "programs").glob("*.pt2")):
            assert archive_problem(program) is None, program
        load(root).check_programs()


# -- the commands ---------------------------------------------------------------------------------


class _NoEngine:
    def __init__(self, catalog, *args, **kwargs):
        raise AssertionError("loaded")


def test_flare_run_refuses_a_pickled_program_in_one_line_and_loads_it_with_the_flag(tiny_copy, tmp_path, monkeypatch):
    install(tiny_copy, "decode_b1", pickled_weight(tiny_copy / "programs/decode_b1.pt2", tmp_path / "p.pt2",
                                                   torch.zeros(2)))
    monkeypatch.setattr(launch, "HeliosEngine", _NoEngine)
    refused = runner.invoke(flare_app, ["run", str(tiny_copy), "--port", "0"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "decode_b1" in lines[0] and "is pickled" in lines[0] and "--trust-catalog" in lines[0]
    trusted = runner.invoke(flare_app, ["run", str(tiny_copy), "--port", "0", "--trust-catalog"])
    assert isinstance(trusted.exception, AssertionError), trusted.output  # it got past loading to the engine


def test_an_aoti_catalog_always_needs_the_flag(tiny_copy, monkeypatch):
    """AOTInductor packages are native code by design: no inspection can vouch for them."""
    raw = yaml.safe_load((tiny_copy / "catalog.yaml").read_text())
    raw["compile"] = "aoti"
    for entry in raw["programs"]:
        entry["compiled_file"], entry["compiled_sha256"] = entry["file"], entry["sha256"]
    (tiny_copy / "catalog.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.setattr(launch, "HeliosEngine", _NoEngine)
    refused = runner.invoke(flare_app, ["run", str(tiny_copy), "--port", "0"])
    assert refused.exit_code == 2 and "AOTInductor package" in refused.stderr and "--trust-catalog" in refused.stderr
    trusted = runner.invoke(flare_app, ["run", str(tiny_copy), "--port", "0", "--trust-catalog"])
    assert isinstance(trusted.exception, AssertionError), trusted.output
    assert runner.invoke(ignition_app, ["inspect", str(tiny_copy)]).exit_code == 0, "inspect loads no program"


def test_debug_serve_refuses_a_pickled_program_before_loading_any(stand_in_copy, tmp_path):
    marker = tmp_path / "ran"
    install(stand_in_copy, "decode_b4", pickled_weight(stand_in_copy / "programs/decode_b4.pt2", tmp_path / "p.pt2",
                                                       _Marker(marker)))
    result = runner.invoke(ignition_app, ["debug-serve", "--direct", str(stand_in_copy), "--port", "0"])
    assert result.exit_code == 2, result.output
    assert "decode_b4" in result.stderr and "is pickled" in result.stderr and not marker.exists()
