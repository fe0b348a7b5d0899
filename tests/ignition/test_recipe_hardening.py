"""Recipes are YAML from users: aliases cannot multiply a document, messages quote values cut short, and
float fields must be finite (issue 17, part 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ignition.cli import app
from ignition.recipes import RecipeError, read_model_dims, read_recipe_file

BUNDLED = Path(__file__).resolve().parents[2] / "ignition" / "recipes"
runner = CliRunner()

HEAD = """\
name: custom
architecture: qwen3
dtype: float32
target: {checkpoint: null}
capacity: {concurrency: 1, prompt_buckets: [64]}
"""


def bomb(levels: int) -> str:
    """``levels`` lists of nine references to the one before: 9**levels strings from a few hundred bytes."""
    rows = ['  - &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    rows += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return HEAD + "description:\n" + "\n".join(rows) + "\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "custom.yaml"
    path.write_text(text)
    return path


def bundled_recipe(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load((BUNDLED / "flare-tiny.yaml").read_text())
    data["name"], data["aliases"] = "custom", []
    for source in ("target", "draft"):
        data[source]["checkpoint"] = str((BUNDLED / data[source]["checkpoint"]).resolve())
    edit(data)
    return write(tmp_path, yaml.safe_dump(data))


def one_line(result) -> str:
    assert result.exit_code == 2, result.output[-500:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


def test_an_alias_bomb_is_refused_in_one_short_line_while_shared_values_still_work(tmp_path):
    """The 9-level bomb used to make `ignition plan` hang; it is refused from its size alone."""
    line = one_line(runner.invoke(app, ["plan", str(write(tmp_path, bomb(9)))]))
    assert "aliases expand to more than" in line and len(line) < 400
    dims = ("{vocab_size: 512, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
            "head_dim: 16, intermediate_size: 128, max_position_embeddings: 2048, rope_theta: 10000.0, "
            "rms_norm_eps: 1.0e-6}")
    text = HEAD.replace("target: {checkpoint: null}", f"target: {{checkpoint: null, dimensions: &dims {dims}}}")
    recipe = read_recipe_file(write(tmp_path, text + "draft: {checkpoint: null, dimensions: *dims}\n"))
    assert recipe.draft.dimensions == recipe.target.dimensions and recipe.dims.hidden_size == 64


def test_a_smaller_bomb_is_refused_too_rather_than_quoted_in_full(tmp_path):
    """Five levels (59,049 strings) used to be echoed whole into the error message."""
    line = one_line(runner.invoke(app, ["plan", str(write(tmp_path, bomb(5)))]))
    assert "aliases expand" in line and len(line) < 400


def test_an_alias_that_contains_itself_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="refers to a value that contains it"):
        read_recipe_file(write(tmp_path, HEAD + "description: &me [*me]\n"))


@pytest.mark.parametrize("field, value", [("rms_norm_eps", ".inf"), ("rms_norm_eps", ".nan"),
                                          ("rope_theta", "-.inf"), ("rope_theta", ".nan")])
def test_float_fields_must_be_finite(tmp_path, field, value):
    path = bundled_recipe(tmp_path, lambda d: None)
    text = path.read_text()
    text = text.replace(f"{field}: ", f"{field}: {value} #", 1)
    path.write_text(text)
    line = one_line(runner.invoke(app, ["plan", str(path)]))
    assert f"dimensions.{field}" in line and "finite" in line
    finite = read_recipe_file(bundled_recipe(tmp_path, lambda d: d["target"]["dimensions"].update({field: 1e-5})))
    assert getattr(finite.dims, field) == 1e-5


def test_a_checkpoint_config_with_infinity_is_refused(tmp_path):
    config = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
              "max_position_embeddings": 2048, "rope_theta": 10000, "rms_norm_eps": float("inf")}
    (tmp_path / "config.json").write_text(json.dumps(config))  # Python's json writes and reads Infinity
    with pytest.raises(RecipeError, match="rms_norm_eps: inf is not finite"):
        read_model_dims(tmp_path)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(dtype="x" * 1_000_000), "dtype"),
    (lambda d: d.update(description=["y" * 1_000_000]), "description"),
    (lambda d: d.update({"z" * 1_000_000: 1}), "zzz"),
    (lambda d: d.update(aliases=["Q" * 1_000_000]), "aliases"),
    (lambda d: d["capacity"].update(proposal_sources=["w" * 1_000_000]), "proposal_sources"),
])
def test_messages_quote_huge_values_cut_short(tmp_path, edit, field):
    line = one_line(runner.invoke(app, ["plan", str(bundled_recipe(tmp_path, edit))]))
    assert field in line and len(line) < 400, len(line)


@pytest.mark.parametrize("field, value", [("hidden_size", "x" * 100_000), ("model_type", "q" * 100_000),
                                          ("rms_norm_eps", ["big"] * 50_000)])
def test_a_huge_checkpoint_config_value_is_cut_in_the_error(tmp_path, field, value):
    """config.json is user data too: a wrong value is named, not echoed whole (one short line)."""
    from test_recipes import QWEN3_CONFIG

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_CONFIG, field: value}))
    with pytest.raises(RecipeError) as caught:
        read_model_dims(tmp_path)
    message = str(caught.value)
    assert field in message and len(message) < 400, message[:500]
