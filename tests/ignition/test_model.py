"""Qwen3 packed paged forward against transformers' Qwen3 (fp32), and checkpoint loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ignition.models.byte_tokenizer import write_tokenizer_files
from ignition.models.checkpoint import ModelLoadError, load_checkpoint, load_config
from ignition.models.qwen3 import PagedBatch, Qwen3
from numerics import assert_close_paths, qwen3_tolerance

transformers = pytest.importorskip("transformers")

BUNDLED = Path(__file__).resolve().parents[2] / "ignition" / "models" / "bundled" / "flare-tiny"
PAGE, PAGES, MAX_PAGES, SLOTS = 4, 40, 8, 4


def hf_tiny(tied: bool) -> "transformers.Qwen3ForCausalLM":
    torch.manual_seed(7 + tied)
    config = transformers.Qwen3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=tied, rms_norm_eps=1e-6,
    )
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():  # transformers initialises norms to one; perturb them so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    write_tokenizer_files(folder)
    return folder


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_pair(request, tmp_path_factory):
    model = hf_tiny(tied=request.param)
    return model, save_hf(model, tmp_path_factory.mktemp("qwen3"))


def _paged_forward(model: Qwen3, weights, cache, tokens, positions, row_slots, query_lens, start):
    page_table = torch.arange(SLOTS * MAX_PAGES, dtype=torch.int32).view(SLOTS, MAX_PAGES).flip(1)
    batch = PagedBatch(page_table, row_slots, query_lens, start)
    hidden = model(weights, tokens, positions, batch, *cache)
    return model.logits(weights, hidden)


@pytest.mark.numerics
def test_C14_packed_prefill_then_paged_decode_matches_transformers(hf_pair):
    hf, folder = hf_pair
    ckpt = load_checkpoint(folder)
    model = Qwen3(ckpt.config)
    cache = [torch.zeros(2, SLOTS * MAX_PAGES, PAGE, 2, 16) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 259, (n,), generator=gen) for n in (5, 11, 3)]
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)  # physical slots unrelated to row order
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    logits = _paged_forward(model, ckpt.weights, cache, torch.cat(prompts), positions, slots, lens, lens * 0)
    worst = 0.0
    with torch.no_grad():
        want = torch.cat([hf(p[None]).logits[0] for p in prompts])
        worst = max(worst, (logits - want).abs().max().item())
        # Two implementations of one model (paged and packed here, dense in transformers): the
        # logits agree within the reordering bound of the model's chain at the longest context.
        tolerance = qwen3_tolerance(ckpt.config, context=int(lens.max()) + 4)
        assert_close_paths(logits, want, tolerance, "prefill logits")
        seqs = list(prompts)
        for _ in range(4):  # decode: one new token per row through the paged cache
            step = torch.randint(0, 259, (len(seqs),), generator=gen)
            starts = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
            logits = _paged_forward(model, ckpt.weights, cache, step, starts.long(), slots, lens * 0 + 1, starts)
            seqs = [torch.cat([s, t[None]]) for s, t in zip(seqs, step)]
            want = torch.stack([hf(s[None]).logits[0, -1] for s in seqs])
            worst = max(worst, (logits - want).abs().max().item())
            assert_close_paths(logits, want, tolerance, "decode logits")
    print(f"max abs logit diff vs transformers: {worst:.3e}")


def test_sharded_checkpoint_loads_the_same_weights(hf_pair, tmp_path):
    hf, folder = hf_pair
    sharded = save_hf(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    single, split = load_checkpoint(folder), load_checkpoint(sharded)
    assert tuple(split.weights) == split.config.weight_keys()
    for key in single.weights:
        assert torch.equal(single.weights[key], split.weights[key]), key


def test_loader_masks_ids_the_tokenizer_does_not_define(hf_pair):
    _, folder = hf_pair
    config = load_config(folder)
    assert config.vocab_size == 300 and config.sampled_vocab_size == 259


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (lambda f: (f / "config.json").write_text("{not json"), "malformed JSON"),
        (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda f: (f / "model.safetensors").unlink(), "neither model.safetensors"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 12), "not a readable safetensors"),
        (lambda f: _edit_config(f, model_type="llama"), "model_type must be 'qwen3'"),
        (lambda f: _edit_config(f, hidden_size=48), "has shape"),
    ],
)
def test_missing_or_malformed_checkpoint_raises_model_load_error(hf_pair, tmp_path, damage, message):
    _, folder = hf_pair
    copy = Path(shutil.copytree(folder, tmp_path / "ckpt"))
    damage(copy)
    with pytest.raises(ModelLoadError, match=message) as err:
        load_checkpoint(copy)
    assert str(copy) in str(err.value)


def test_missing_folder_is_named():
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_checkpoint("/nonexistent/qwen3")


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.numerics
@pytest.mark.parametrize("role", ["target", "draft"])
def test_bundled_checkpoint_loads_in_transformers_and_matches(role):
    folder = BUNDLED / role
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("Flare <|im_end|>")["input_ids"]
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the special token survives encoding
    ckpt = load_checkpoint(folder, torch.float32)  # shipped in bf16; compared in fp32 as capture runs it
    assert ckpt.config.sampled_vocab_size == len(tokenizer)
    model = Qwen3(ckpt.config)
    c = ckpt.config
    cache = [torch.zeros(c.num_layers, SLOTS * MAX_PAGES, PAGE, c.num_kv_heads, c.head_dim) for _ in range(2)]
    tokens = torch.tensor(ids)
    one = torch.ones(1, dtype=torch.int32)
    logits = _paged_forward(model, ckpt.weights, cache, tokens, torch.arange(len(ids)), one * 0, one * len(ids), one * 0)
    with torch.no_grad():
        assert_close_paths(logits, hf(tokens[None]).logits[0], qwen3_tolerance(c, len(ids)), f"{role} logits")
