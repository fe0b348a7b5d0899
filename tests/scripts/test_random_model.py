"""The 0.6B-shaped random checkpoint's generator (benchmarks/peers/random_model.py, issue 22 item 5), on a small shape."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.peers import random_model

SMALL = dict(random_model.SHAPE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128)


def test_the_default_shape_is_qwen3_0_6b():
    shape = random_model.SHAPE
    assert (shape["num_hidden_layers"], shape["hidden_size"], shape["intermediate_size"]) == (28, 1024, 3072)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]) == (16, 8, 128)
    assert shape["tie_word_embeddings"]


def test_seeded_with_a_fixed_init_scale_and_greedy_never_emits_eos(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    a = random_model.write(tmp_path / "a", seed=3, shape=SMALL)
    b = random_model.write(tmp_path / "b", seed=3, shape=SMALL)
    c = random_model.write(tmp_path / "c", seed=4, shape=SMALL)
    wa, wb, wc = (load_file(str(f / "model.safetensors")) for f in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # same seed, same weights
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    embed = wa["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32
    assert torch.count_nonzero(embed[random_model.EOS_ID]) == 0
    others = torch.cat([embed[: random_model.EOS_ID], embed[random_model.EOS_ID + 1:]])
    assert abs(others.std().item() - random_model.INIT_STD) < 0.1 * random_model.INIT_STD
    config = json.loads((a / "config.json").read_text())
    assert config["vocab_size"] == json.loads((random_model.TOKENIZER / "config.json").read_text())["vocab_size"]
    assert (a / "tokenizer.json").read_bytes() == (random_model.TOKENIZER / "tokenizer.json").read_bytes()
    model = Qwen3ForCausalLM.from_pretrained(a).eval()
    with torch.no_grad():
        logits = model(torch.randint(3, config["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(0))).logits
    assert not torch.any(logits.argmax(-1) == random_model.EOS_ID)
    assert logits.std().item() > 0.1  # not degenerate: the logits spread


def test_an_existing_checkpoint_with_the_same_seed_is_kept(tmp_path):
    pytest.importorskip("transformers")
    folder = random_model.write(tmp_path / "m", seed=1, shape=SMALL)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    random_model.write(folder, seed=1, shape=SMALL)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_refuses_a_folder_inside_the_repository(capsys):
    code = random_model.main(["--out", str(random_model.REPO / "models" / "x")])
    assert code == 2 and capsys.readouterr().err.startswith("error: --out")
