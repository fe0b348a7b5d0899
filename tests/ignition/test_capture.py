"""ignition.capture: the catalog writer (issue 2 item 5; C11).

Uses the stand-in source (ignition.capture.stand_in), so these run without the
real model; the real model's round trip is in test_capture_model.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from helios.catalog import load
from ignition.capture import CaptureError, CaptureObserver, StagingError, write_catalog
from ignition.capture.export import export_program
from ignition.capture.stand_in import StandInSpec, stand_in_source


@pytest.fixture
def tokenizer(tmp_path) -> Path:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": "stand-in"}')
    return path


class FailAfter(CaptureObserver):
    """Interrupts the capture after ``count`` programs, as a crash or Ctrl-C would."""

    def __init__(self, count: int):
        self.count = count

    def program_done(self, descriptor) -> None:
        self.count -= 1
        if self.count == 0:
            raise KeyboardInterrupt


def test_same_source_gives_the_same_manifest_and_files(tmp_path, tokenizer):
    first = write_catalog(stand_in_source(tokenizer), tmp_path / "a").path
    second = write_catalog(stand_in_source(tokenizer), tmp_path / "b").path
    assert (first / "catalog.yaml").read_bytes() == (second / "catalog.yaml").read_bytes()
    files = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)


def test_C11_manifest_writes_zero_durations_and_no_timestamps(tmp_path, tokenizer):
    graphs = tuple(dataclasses.replace(g, estimated_duration_ns=99) for g in stand_in_source(tokenizer).graphs)
    root = write_catalog(stand_in_source(tokenizer, graphs), tmp_path / "c").path
    raw = yaml.safe_load((root / "catalog.yaml").read_text())
    assert [p["estimated_duration_ns"] for p in raw["programs"]] == [0, 0, 0]
    assert not {"created", "timestamp", "captured_at"} & set(raw)


def test_weights_are_stored_once_and_not_embedded_in_programs(tmp_path, tokenizer):
    source = stand_in_source(tokenizer)
    root = write_catalog(source, tmp_path / "c").path
    assert [p.name for p in (root / "weights").iterdir()] == ["target.safetensors"]
    embed = source.weights["target"]["embed"].numpy().tobytes()
    for program in (root / "programs").iterdir():
        assert embed[:64] not in program.read_bytes(), f"{program.name} embeds the weights"
    manifest = load(root).manifest
    assert all(p.inputs[0].weights == "target" for p in manifest.programs)


def test_state_is_what_programs_mutate(tmp_path, tokenizer):
    manifest = load(write_catalog(stand_in_source(tokenizer), tmp_path / "c").path).manifest
    assert [t.name for t in manifest.state.tensors] == ["pending", "seq_lens", "cache"]
    inputs = {a.name: a for a in manifest.programs[0].inputs}
    assert not inputs["prompt_tokens"].mutated and not inputs["row_slots"].mutated
    assert inputs["cache"].mutated and inputs["pending"].mutated


def test_interrupted_capture_leaves_no_catalog(tmp_path, tokenizer):
    with pytest.raises(KeyboardInterrupt):
        write_catalog(stand_in_source(tokenizer), tmp_path / "c", FailAfter(2))
    assert not (tmp_path / "c").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"], "staging folder left behind"


def test_interrupted_recapture_keeps_the_previous_catalog(tmp_path, tokenizer):
    target = write_catalog(stand_in_source(tokenizer), tmp_path / "c").path
    before = (target / "catalog.yaml").read_bytes()
    with pytest.raises(KeyboardInterrupt):
        write_catalog(stand_in_source(tokenizer, seed=1), target, FailAfter(1))
    assert (target / "catalog.yaml").read_bytes() == before
    assert load(target).descriptors


def test_completed_recapture_replaces_the_previous_catalog(tmp_path, tokenizer):
    target = write_catalog(stand_in_source(tokenizer), tmp_path / "c").path
    old = load(target).manifest.weights[0].sha256
    write_catalog(stand_in_source(tokenizer, seed=1), target)
    assert load(target).manifest.weights[0].sha256 != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "tokenizer.json"]


def test_unwritable_out_is_a_clear_error(tmp_path, tokenizer):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StagingError, match="cannot create the output folder"):
        write_catalog(stand_in_source(tokenizer), blocker / "c")
    with pytest.raises(StagingError, match="not a folder"):
        write_catalog(stand_in_source(tokenizer), blocker)


def test_aoti_is_refused_until_supported(tmp_path, tokenizer):
    with pytest.raises(CaptureError, match="--compile aoti is not supported yet"):
        write_catalog(stand_in_source(tokenizer), tmp_path / "c", compile="aoti")
    assert not (tmp_path / "c").exists()


class WritesThroughAView(torch.nn.Module):
    def forward(self, cache, index, value):
        cache[1].index_put_((index,), value)  # a per-layer view of the base cache
        return (value * 2,)


def test_mutation_through_a_view_marks_the_base_input(tmp_path):
    spec = StandInSpec(
        module=WritesThroughAView(),
        example_args=(torch.zeros(2, 4, 3), torch.tensor([1]), torch.ones(1, 3)),
        input_names=("cache", "index", "value"),
        output_names=("doubled",),
        weight_keys=(),
    )
    exported = export_program(spec, tmp_path / "p.pt2", {})
    assert [(a.name, a.mutated) for a in exported.inputs] == [("cache", True), ("index", False), ("value", False)]
    assert exported.outputs[0].shape == (1, 3)
