"""`ignition recipes` and `ignition plan`: output, JSON shape, and one-line errors with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flare_contract.graphs import GraphKind
from ignition.capacity import CapacityOptions, plan_capacity
from ignition.cli import app
from ignition.recipes import load_recipe

BUNDLED = Path(__file__).resolve().parents[2] / "ignition" / "recipes"
QWEN3_CONFIG = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "max_position_embeddings": 2048, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def write_recipe(tmp_path: Path, edit) -> Path:
    """A copy of the bundled flare-tiny recipe under another name, edited as a dict."""
    data = yaml.safe_load((BUNDLED / "flare-tiny.yaml").read_text())
    data["name"], data["aliases"] = "custom", []
    for source in ("target", "draft"):
        data[source]["checkpoint"] = str((BUNDLED / data[source]["checkpoint"]).resolve())
    edit(data)
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def write_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    return folder

runner = CliRunner()
SHAPE_KEYS = {"kind", "batch_capacity", "proposal_depth", "width", "aggregate", "prefill_capacity",
              "speculation_enabled", "value_source"}


def invoke(*args: str):
    return runner.invoke(app, list(args))


def assert_one_line_error(result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_recipes_lists_names_and_aliases():
    result = invoke("recipes")
    assert result.exit_code == 0, result.output
    for word in ("flare-tiny", "default", "qwen3", "qwen3.8-flash", "--model PATH"):
        assert word in result.stdout


def test_plan_json_document():
    result = invoke("plan", "default", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) == {"recipe", "envelope", "max_packed_tokens", "shapes"}
    assert doc["recipe"] == "flare-tiny"
    expected = plan_capacity(load_recipe("flare-tiny"))
    assert [s["id"] for s in doc["shapes"]] == [g.id for g in expected.graphs]
    for shape in doc["shapes"]:
        assert SHAPE_KEYS <= set(shape)
        assert shape["kind"] in {k.value for k in GraphKind}
        assert shape["value_source"] in (None, "query_length", "prefix_limit")
    assert doc["envelope"]["request_slots"] == 16 and doc["envelope"]["mixed"] is False
    assert doc["max_packed_tokens"] == 4096


def test_C3_C10_plan_json_with_overrides_and_mixed():
    result = invoke("plan", "flare-tiny", "--json", "--mixed-prefill", "--concurrency", "2",
                    "--prefill-chunk", "256", "--drafts", "1", "--speculative-token-capacity", "4")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    env = doc["envelope"]
    assert (env["request_buckets"], env["prompt_buckets"], env["draft_depth"], env["mixed"]) == (
        [1, 2], [64, 256], 1, True)
    mixed = [s for s in doc["shapes"] if s["kind"] == "mixed"]
    # B = 2 only: 2 prompt buckets x (ordinary + speculative) + one wider width (2*2 <= 4)
    assert len(mixed) == 5
    # the 256-token prompt row plus one width-one row beats the wider W = 2 program (at bucket 64)
    assert [s["prefill_capacity"] for s in mixed if s["width"] == 2] == [64]
    assert doc["max_packed_tokens"] == 256 + (2 - 1) * 1


def test_C9_plan_reports_the_worked_example():
    result = invoke("plan", "qwen3.8-flash", "--mixed-prefill", "--json")
    mixed = [s for s in json.loads(result.stdout)["shapes"] if s["kind"] == "mixed"]
    assert sum(s["speculation_enabled"] for s in mixed) == 22
    assert sum(not s["speculation_enabled"] for s in mixed) == 20


def test_plan_table_shows_counts_by_kind():
    result = invoke("plan", "default")
    assert result.exit_code == 0, result.output
    plan = plan_capacity(load_recipe("default"))
    assert f"{len(plan.graphs)} programs" in result.stdout
    assert f"speculative {plan.counts_by_kind()['speculative']}" in result.stdout
    assert "max packed tokens: 4096" in result.stdout


def test_plan_is_deterministic():
    first = invoke("plan", "default", "--mixed-prefill", "--json").stdout
    assert first == invoke("plan", "default", "--mixed-prefill", "--json").stdout


def test_qwen3_plan_reads_config_from_model(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")  # context 2048
    result = invoke("plan", "qwen3", "--model", str(folder), "--json", "--prefill-chunk", "1024")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["envelope"]["context_length"] == 2048
    assert doc["envelope"]["prompt_buckets"] == [64, 256, 1024]


def test_qwen3_without_model_asks_for_it():
    assert_one_line_error(invoke("plan", "qwen3"), "--model PATH")


def test_plan_by_recipe_path(tmp_path):
    path = write_recipe(tmp_path, lambda d: d["capacity"].update(concurrency=2))
    result = invoke("plan", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["envelope"]["request_buckets"] == [1, 2]


# -- bad input: one line naming what is wrong and what would be right, exit 2 -------------------


def test_unknown_recipe_lists_known_ones():
    assert_one_line_error(invoke("plan", "llama-9000"), "unknown recipe 'llama-9000'", "flare-tiny", "qwen3")


def test_unknown_recipe_field(tmp_path):
    path = write_recipe(tmp_path, lambda d: d["capacity"].update(max_batch=8))
    assert_one_line_error(invoke("plan", str(path)), str(path), "capacity.max_batch", "unknown field")


def test_malformed_recipe_field(tmp_path):
    path = write_recipe(tmp_path, lambda d: d["capacity"].update(drafts="three"))
    assert_one_line_error(invoke("plan", str(path)), "capacity.drafts", "expected an integer")


def test_malformed_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [\n")
    assert_one_line_error(invoke("plan", str(path)), "not valid YAML")


def test_C5_non_power_of_two_batch(tmp_path):
    path = write_recipe(tmp_path, lambda d: d["capacity"].update(request_buckets=[1, 3, 4]))
    assert_one_line_error(invoke("plan", str(path)), "capacity.request_buckets", "3 is not a power of two")


@pytest.mark.parametrize("chunk", ["100", "0", "-64"])
def test_C7_prefill_chunk_not_aligned_to_64(chunk):
    assert_one_line_error(invoke("plan", "default", "--prefill-chunk", chunk), "multiple of 64")


def test_C7_recipe_prompt_bucket_not_aligned_to_64(tmp_path):
    path = write_recipe(tmp_path, lambda d: d["capacity"].update(prompt_buckets=[64, 200]))
    assert_one_line_error(invoke("plan", str(path)), "capacity.prompt_buckets", "200 is not a positive multiple of 64")


def test_C5_R_too_small_for_any_wider_width():
    assert_one_line_error(invoke("plan", "default", "--speculative-token-capacity", "1"),
                          "admits no width above one", "R >= 2")


def test_C3_mixed_prefill_on_recipe_without_mixed_capture(tmp_path):
    message = assert_one_line_error(invoke("plan", "qwen3", "--mixed-prefill"), "does not declare mixed capture")
    assert "--model" not in message  # the flag error does not wait for a checkpoint
    folder = write_checkpoint(tmp_path / "ckpt")
    assert_one_line_error(invoke("plan", "qwen3", "--model", str(folder), "--mixed-prefill"), "mixed capture")


def test_model_folder_without_config(tmp_path):
    assert_one_line_error(invoke("plan", "qwen3", "--model", str(tmp_path)), "no config.json")


def test_debug_shows_the_exception():
    result = invoke("--debug", "plan", "default", "--speculative-token-capacity", "1")
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "CapacityError"


def test_every_command_has_help():
    for args in (["--help"], ["recipes", "--help"], ["plan", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    assert "--speculative-token-capacity" in invoke("plan", "--help").stdout


def test_plan_matches_library_for_every_bundled_recipe_with_declared_dims():
    for name in ("flare-tiny", "qwen3.8-flash"):
        doc = json.loads(invoke("plan", name, "--json", "--mixed-prefill").stdout)
        plan = plan_capacity(load_recipe(name), CapacityOptions(mixed_prefill=True))
        assert doc == json.loads(json.dumps(plan.to_dict()))
        assert yaml.safe_dump(plan.to_dict())  # plain values: a catalog manifest can embed it
