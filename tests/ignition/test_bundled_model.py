"""The shipped flare-tiny pair (issue 7): its files, its loaders, and that it learned something.

These check the committed weights, not the training script (tests/scripts/
test_train_bundled_model.py covers the script on a toy run). The held-out
files are the training run's own split (whole standard-library files chosen
by a hash of their path), so the quality checks read text the models never
trained on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignition.models.checkpoint import load_checkpoint
from ignition.recipes import load_recipe, read_model_dims
from scripts.bundled_model import evaluate as ev
from scripts.bundled_model.corpus import default_root, load_corpus
from scripts.train_bundled_model import encode

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

BUNDLED = Path(__file__).resolve().parents[2] / "ignition" / "models" / "bundled" / "flare-tiny"
HELDOUT_PERCENT = 5.0  # the training run's default split
SIZE_LIMIT = 30 * 2**20  # issue 7: the pair under 30 MB


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("flare-tiny").resolve()


@pytest.fixture(scope="module")
def pair():
    load = transformers.Qwen3ForCausalLM.from_pretrained
    return {name: load(BUNDLED / name, torch_dtype=torch.float32).eval() for name in ("target", "draft")}


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.Tokenizer.from_file(str(BUNDLED / "target" / "tokenizer.json"))


@pytest.fixture(scope="module")
def heldout():
    corpus = load_corpus(default_root(), HELDOUT_PERCENT)
    if not corpus.heldout:
        pytest.skip("this interpreter's standard library has no held-out files")
    return corpus


def test_pair_fits_the_size_limit():
    total = sum(f.stat().st_size for f in BUNDLED.rglob("*") if f.is_file())
    assert total < SIZE_LIMIT, f"bundled pair is {total / 2**20:.1f} MiB, over 30 MiB"


def test_recipe_dimensions_match_the_shipped_configs(recipe):
    for source in (recipe.target, recipe.draft):
        assert read_model_dims(source.checkpoint) == source.dimensions, source.checkpoint


def test_flare_and_transformers_load_the_same_weights(pair):
    for name, model in pair.items():
        ours = load_checkpoint(BUNDLED / name, torch.float32).weights
        theirs = dict(model.named_parameters())
        for key, tensor in ours.items():
            assert torch.equal(tensor, theirs[key].detach()), f"{name}: {key} differs"


def test_tokenizer_shares_vocabulary_and_special_tokens(tokenizer, pair):
    draft_tokenizer = tokenizers.Tokenizer.from_file(str(BUNDLED / "draft" / "tokenizer.json"))
    assert tokenizer.get_vocab() == draft_tokenizer.get_vocab()
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.token_to_id(special) is not None
    assert tokenizer.get_vocab_size() <= pair["target"].config.vocab_size
    text = "def add(a, b):\n    return a + b\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_draft_agrees_with_target_on_heldout_python(pair, tokenizer, heldout):
    """Issue 7's goal: teacher-forced greedy agreement >= 0.6 on held-out files."""
    stream = encode(tokenizer, heldout.heldout)
    metrics = ev.window_metrics(pair["target"], pair["draft"], ev.stream_windows(stream, 512, 4))
    assert metrics["greedy_agreement"] >= 0.6, metrics
    # Far better than chance over a 4096-token vocabulary: the target learned the language.
    assert metrics["target_top1_accuracy"] > 0.3, metrics


def test_greedy_continuations_of_heldout_headers_parse(pair, tokenizer, heldout):
    """Issue 7 asks that most parse, or that the fraction be stated: the shipped pair parses 6 of the
    training run's 20 headers and 3 of these 8 (docs/bundled-model.md). Seeded random weights parse
    none, so two of eight separates a trained model from an untrained one without pinning today's figure."""
    headers = ev.function_headers(heldout.heldout, 8, seed=0)
    settings = ev.EvalSettings(context=512, windows=0, long_windows=0, spec_prompts=0, spec_prompt_tokens=0,
                               spec_new_tokens=0, headers=len(headers), header_context_chars=4 * 512,
                               header_new_tokens=48, samples=0, seed=0)
    stops = frozenset(tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>"))
    result = ev.header_metrics(pair["target"], tokenizer, headers, settings, stops)
    assert result["parsed"] >= 2, result
