"""Recipes: bundled YAML loads into frozen dataclasses; bad recipes fail with file, field and remedy."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from ignition.recipes import ModelDims, RecipeError, list_recipes, load_recipe, read_model_dims, read_recipe_file

BUNDLED = Path(__file__).resolve().parents[2] / "ignition" / "recipes"

QWEN3_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def write_recipe(tmp_path: Path, edit=None, name: str = "custom.yaml") -> Path:
    """A copy of the bundled flare-tiny recipe, optionally edited as a dict."""
    data = yaml.safe_load((BUNDLED / "flare-tiny.yaml").read_text())
    data["name"], data["aliases"] = "custom", []
    for source in ("target", "draft"):  # keep the bundled checkpoints reachable from tmp
        data[source]["checkpoint"] = str((BUNDLED / data[source]["checkpoint"]).resolve())
    if edit:
        edit(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def write_checkpoint(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_CONFIG | changes))
    return folder


def test_bundled_recipes_names_and_aliases():
    names = {r.name: r for r in list_recipes()}
    assert {"flare-tiny", "qwen3", "qwen38"} <= set(names)
    assert load_recipe("default") is names["flare-tiny"]
    assert load_recipe("qwen3.8-flash") is names["qwen38"]


def test_recipes_are_frozen_and_loaded_once(tmp_path):
    recipe = load_recipe("flare-tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.name = "other"  # type: ignore[misc]
    path = write_recipe(tmp_path)
    assert load_recipe(str(path)) is load_recipe(path)


def test_flare_tiny_declares_the_issue_defaults():
    recipe = load_recipe("flare-tiny")
    cap = recipe.capacity
    assert (cap.concurrency, cap.prompt_buckets, cap.drafts) == (16, (64, 256, 1024, 4096), 3)  # issue 22: 16 streams
    assert (recipe.compile.mode, recipe.compile.kinds) == ("aoti", ("prefill", "decode", "speculative"))
    assert recipe.compile.max_width == 1  # adaptive's width-one rounds compiled, the wider ones exported
    assert recipe.compile.max_prompt == 256  # prefill compiled through the 256 bucket, 1,024 and 4,096 exported
    assert recipe.checkpoints.rows == 8  # issue 21: 160 MiB of checkpoint store (docs/checkpoints.md)
    assert set(cap.proposal_sources) == {"learned", "copy"}
    assert recipe.dtype == "float32" and recipe.dims.context_length >= 4096
    assert recipe.draft is not None and recipe.draft.dimensions.vocab_size == recipe.dims.vocab_size
    assert recipe.target.checkpoint.parts[-4:] == ("models", "bundled", "flare-tiny", "target")


def test_C3_mixed_capture_is_declared_by_the_flash_stand_in_and_not_by_qwen3():
    assert load_recipe("qwen3.8-flash").capacity.mixed_capture
    assert load_recipe("flare-tiny").capacity.mixed_capture
    assert not load_recipe("qwen3").capacity.mixed_capture


def test_flare_tiny_dimensions_match_the_bundled_checkpoint():
    recipe = load_recipe("flare-tiny")
    for source in (recipe.target, recipe.draft):
        if not (source.checkpoint / "config.json").is_file():
            pytest.fail(f"bundled checkpoint missing: {source.checkpoint}")
        assert read_model_dims(source.checkpoint) == source.dimensions


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(RecipeError, match=r"unknown recipe 'nope'.*flare-tiny \(alias default\).*qwen3"):
        load_recipe("nope")


def test_missing_recipe_file_says_so(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda d: d.update(colour="red"), "colour", "unknown field"),
        (lambda d: d["capacity"].update(batchsize=3), "capacity.batchsize", "unknown field"),
        (lambda d: d.pop("dtype"), "dtype", "missing"),
        (lambda d: d.update(dtype="int8"), "dtype", "one of float32, bfloat16, float16"),
        (lambda d: d["capacity"].update(concurrency="four"), "capacity.concurrency", "expected an integer"),
        (lambda d: d["capacity"].update(concurrency=True), "capacity.concurrency", "expected an integer"),
        (lambda d: d["capacity"].update(concurrency=65), "capacity.concurrency", "1 through 64"),
        (lambda d: d["capacity"].update(prompt_buckets=[64, 100]), "capacity.prompt_buckets", "multiple of 64"),
        (lambda d: d["capacity"].update(prompt_buckets=[256, 64]), "capacity.prompt_buckets", "ascending"),
        (lambda d: d["capacity"].update(prompt_buckets=[]), "capacity.prompt_buckets", "empty"),
        (lambda d: d["capacity"].update(prompt_buckets=[64, 8192]), "capacity.prompt_buckets", "context of 4096"),
        (lambda d: d["capacity"].update(request_buckets=[1, 3]), "capacity.request_buckets", "power of two"),
        (lambda d: d["capacity"].update(request_buckets=[1, 32]), "capacity.request_buckets", "padded concurrency"),
        (lambda d: d.update(compile={"mode": "jit"}), "compile.mode", "none, aoti"),
        (lambda d: d.update(compile={"mode": "aoti", "kinds": ["vision"]}), "compile.kinds", "prefill, scored_prefill"),
        (lambda d: d.update(compile={"mode": "aoti", "max_width": 0}), "compile.max_width", "below 1"),
        (lambda d: d.update(compile={"mode": "aoti", "max_prompt": 0}), "compile.max_prompt", "below 1"),
        (lambda d: d["capacity"].update(proposal_sources=["oracle"]), "capacity.proposal_sources", "learned, copy"),
        (lambda d: d["capacity"].update(drafts=8), "capacity.drafts", "completion_token_capacity"),
        (lambda d: d.pop("draft"), "draft", "'learned'"),
        (lambda d: d.update(kv_page_size=12), "kv_page_size", "power of two"),
        (lambda d: d.update(checkpoints={"rows": -1}), "checkpoints.rows", "0 through 256"),
        (lambda d: d.update(checkpoints={"slots": 4}), "checkpoints.slots", "unknown field"),
        (lambda d: d["capacity"].update(speculative_token_capacity=0), "capacity.speculative_token_capacity",
         "integer >= 1"),
        (lambda d: d["target"]["dimensions"].update(num_key_value_heads=4), "target.dimensions",
         "multiple of num_key_value_heads"),
        (lambda d: d["target"]["dimensions"].update(hidden_size=0), "target.dimensions.hidden_size", "positive"),
        (lambda d: d["target"]["dimensions"].pop("vocab_size"), "target.dimensions.vocab_size", "missing"),
        (lambda d: d.update(aliases="x"), "aliases", "expected a list"),
        (lambda d: d.update(name="Bad Name"), "name", "plain name"),
    ],
)
def test_bad_recipe_fields_name_file_field_and_what_is_allowed(tmp_path, edit, field, words):
    path = write_recipe(tmp_path, edit)
    with pytest.raises(RecipeError) as info:
        read_recipe_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}:"), message
    assert words in message
    assert "\n" not in message


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ncapacity: [unclosed\n")
    with pytest.raises(RecipeError, match=r"broken.yaml: not valid YAML at line \d+"):
        read_recipe_file(path)


def test_recipe_document_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="not a mapping"):
        read_recipe_file(path)


def test_relative_checkpoint_is_relative_to_the_recipe_file(tmp_path):
    path = write_recipe(tmp_path, lambda d: d["target"].update(checkpoint="weights/here"))
    assert read_recipe_file(path).target.checkpoint == (tmp_path / "weights" / "here").resolve()


def test_qwen3_needs_model_and_reads_config(tmp_path):
    recipe = load_recipe("qwen3")
    with pytest.raises(RecipeError, match="--model PATH"):
        recipe.resolve()
    with pytest.raises(RecipeError, match="--model PATH"):
        recipe.dims
    resolved = recipe.resolve(write_checkpoint(tmp_path / "ckpt"))
    assert resolved.dims == ModelDims(**{f.name: QWEN3_CONFIG[f.name] for f in dataclasses.fields(ModelDims)})
    assert resolved.target.checkpoint == tmp_path / "ckpt"


def test_config_with_nested_rope_theta(tmp_path):
    config = {k: v for k, v in QWEN3_CONFIG.items() if k != "rope_theta"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert read_model_dims(folder).rope_theta == 5000.0


def test_config_without_head_dim_derives_it(tmp_path):
    config = dict(QWEN3_CONFIG)
    del config["head_dim"]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert read_model_dims(folder).head_dim == 64 // 4


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda f: None, "does not exist"),
        (lambda f: f.mkdir(), "no config.json"),
        (lambda f: write_checkpoint(f, model_type="llama"), "model_type 'llama' is not supported"),
        (lambda f: write_checkpoint(f, vocab_size="big"), "vocab_size is 'big'"),
        (lambda f: write_checkpoint(f, num_key_value_heads=3), "multiple of num_key_value_heads"),
        (lambda f: write_checkpoint(f, hidden_size=0), "hidden_size: 0 is not positive"),
    ],
)
def test_bad_checkpoint_config_is_one_clear_error(tmp_path, setup, words):
    folder = tmp_path / "ckpt"
    setup(folder)
    with pytest.raises(RecipeError, match=words) as info:
        load_recipe("qwen3").resolve(folder)
    assert "\n" not in str(info.value)


def test_broken_config_json(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(RecipeError, match="config.json: not valid JSON"):
        load_recipe("qwen3").resolve(folder)


def test_model_flag_must_match_declared_dimensions(tmp_path):
    with pytest.raises(RecipeError, match=r"vocab_size is 512 but recipe 'flare-tiny' declares 4096.*'qwen3' recipe"):
        load_recipe("flare-tiny").resolve(write_checkpoint(tmp_path / "ckpt"))


def test_declared_dimensions_need_no_checkpoint():
    recipe = load_recipe("qwen3.8-flash")
    assert recipe.target.checkpoint is None
    assert recipe.resolve() is recipe
    with pytest.raises(RecipeError, match="no bundled checkpoint"):
        recipe.checkpoint_folder()


def test_docs_example_recipe_is_valid(tmp_path):
    """The YAML shown in docs/cli.md must load."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    block = docs.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "doc.yaml"
    path.write_text(textwrap.dedent(block))
    recipe = read_recipe_file(path)
    assert recipe.name == "my-qwen3"


def test_reads_a_config_saved_by_transformers(tmp_path):
    """Whatever layout the installed transformers writes (it nests rope_theta since v5)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    dims = load_recipe("qwen3").resolve(tmp_path).dims
    assert (dims.vocab_size, dims.hidden_size, dims.head_dim, dims.context_length) == (256, 64, 16, 1024)
    assert dims.tie_word_embeddings and dims.rope_theta > 0
