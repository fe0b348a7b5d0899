"""`ignition capture` and `ignition inspect`: output, JSON, and one-line errors with exit 2 (C10)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flare_contract.manifest import FORMAT_VERSION
from ignition.capture import write_catalog
from ignition.capture.stand_in import stand_in_source
from conftest import CLI_CAPTURE_OPTIONS
from ignition.cli import app

runner = CliRunner()
SMALL = CLI_CAPTURE_OPTIONS  # three programs, captured once per session by the cli_capture fixture


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def captured(cli_capture) -> Path:
    return cli_capture.folder


@pytest.fixture
def stand_in(tmp_path) -> Path:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    return write_catalog(stand_in_source(tokenizer), tmp_path / "catalog").path


def test_capture_then_inspect_json_reports_the_catalog(captured):
    result = invoke("inspect", captured, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["counts_by_kind"] == {"decode": 1, "prefill": 1, "scored_prefill": 1}
    assert report["format_version"] == FORMAT_VERSION and report["recipe"]["name"] == "flare-tiny"
    assert report["envelope"]["request_slots"] == 1 and report["envelope"]["draft_depth"] == 0


def test_capture_prints_a_summary_with_counts_size_and_time(cli_capture):
    result = cli_capture  # the one capture of these programs, and what it printed (tests/conftest.py)
    assert result.exit_code == 0
    # prefill, scored prefill and decode, and the recipe's state programs at B = 1 (snapshot, restore, init)
    assert "captured 6 programs (decode 1, init 1, prefill 1, restore 1, scored_prefill 1, snapshot 1)" in result.stdout
    assert "load checkpoint" in result.stderr and "export 6 programs" in result.stderr
    assert (cli_capture.folder / "catalog.yaml").is_file()


def test_capture_resolves_recipe_aliases(tmp_path):
    """``default`` names flare-tiny: planning through the alias gives the same shapes (no second capture)."""
    by_alias = json.loads(invoke("plan", "default", *SMALL, "--json").stdout)
    by_name = json.loads(invoke("plan", "flare-tiny", *SMALL, "--json").stdout)
    assert by_alias["shapes"] == by_name["shapes"] and by_alias["shapes"]


def test_C10_inspect_lists_exactly_the_programs_plan_reports(captured):
    planned = json.loads(invoke("plan", "flare-tiny", *SMALL, "--json").stdout)
    report = json.loads(invoke("inspect", captured, "--json").stdout)
    assert [p["id"] for p in report["programs"]] == [s["id"] for s in planned["shapes"]]
    for program, shape in zip(report["programs"], planned["shapes"]):
        for key in ("kind", "batch_capacity", "proposal_depth", "width", "prefill_capacity", "value_source"):
            assert program[key] == shape[key], (program["id"], key)
        assert program["estimated_duration_ns"] == 0  # C11
    assert report["envelope"]["max_packed_tokens"] == planned["max_packed_tokens"]


def test_inspect_json_lists_file_sizes_that_add_up(captured):
    report = json.loads(invoke("inspect", captured, "--json").stdout)
    on_disk = {str(p.relative_to(captured)): p.stat().st_size for p in captured.rglob("*") if p.is_file()}
    assert report["files"] == on_disk
    assert report["total_bytes"] == sum(on_disk.values())
    assert all(p["bytes"] == on_disk[p["file"]] for p in report["programs"])


def test_inspect_table_shows_every_descriptor(stand_in):
    result = invoke("inspect", stand_in)
    assert result.exit_code == 0, result.output
    for text in ("format version", "stand-in", "prefill_p8", "decode_b1", "decode_b4", "weights/target.safetensors"):
        assert text in result.stdout, text


def test_inspect_refuses_a_folder_that_is_not_a_catalog(tmp_path):
    assert_one_line_error(invoke("inspect", tmp_path), "not a catalog")


def test_inspect_refuses_a_truncated_program_naming_it(stand_in):
    program = stand_in / "programs" / "decode_b1.pt2"
    program.write_bytes(program.read_bytes()[:100])
    assert_one_line_error(invoke("inspect", stand_in), "decode_b1.pt2", "truncated or modified")


def test_inspect_refuses_another_format_version(stand_in):
    raw = yaml.safe_load((stand_in / "catalog.yaml").read_text())
    raw["format_version"] = 7
    (stand_in / "catalog.yaml").write_text(yaml.safe_dump(raw))
    assert_one_line_error(invoke("inspect", stand_in), "version 7", f"version {FORMAT_VERSION}")


def test_capture_refuses_a_missing_checkpoint_folder(tmp_path):
    assert_one_line_error(invoke("capture", "qwen3", "--out", tmp_path / "c", "--model", tmp_path / "nope"),
                          "does not exist")


def test_capture_refuses_a_malformed_checkpoint_config(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    assert_one_line_error(invoke("capture", "qwen3", "--out", tmp_path / "c", "--model", folder), "config.json")


def test_capture_refuses_a_checkpoint_without_weights(tmp_path):
    bundled = Path(__file__).resolve().parents[2] / "ignition" / "models" / "bundled" / "flare-tiny" / "target"
    folder = Path(shutil.copytree(bundled, tmp_path / "ckpt"))
    (folder / "model.safetensors").unlink()
    assert_one_line_error(invoke("capture", "qwen3", "--out", tmp_path / "c", "--model", folder), "safetensors")


def test_capture_refuses_an_unwritable_out(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_line_error(invoke("capture", "flare-tiny", "--out", blocker / "c"), "not a folder")


def test_C3_capture_refuses_mixed_prefill_on_a_recipe_without_mixed_capture(tmp_path):
    assert_one_line_error(invoke("capture", "qwen3", "--out", tmp_path / "c", "--mixed-prefill"), "C3")


def test_capture_refuses_an_unknown_compile_mode(tmp_path):
    assert_one_line_error(invoke("capture", "flare-tiny", "--out", tmp_path / "c", "--compile", "fast"), "none, aoti")
    assert not (tmp_path / "c").exists()


def test_capture_refuses_zero_jobs(tmp_path):
    assert_one_line_error(invoke("capture", "flare-tiny", "--out", tmp_path / "c", "--jobs", "0"), "--jobs must be >= 1")
    assert not (tmp_path / "c").exists()


def test_capture_refuses_an_unknown_compile_kind(tmp_path):
    assert_one_line_error(invoke("capture", "flare-tiny", "--out", tmp_path / "c", "--compile-kinds", "decode,vision"),
                          "vision", "prefill")
