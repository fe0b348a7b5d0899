"""Write the bundled flare-tiny target and draft checkpoints (seeded, reproducible).

    .venv/bin/python scripts/make_bundled_model.py [--out ignition/models/bundled/flare-tiny]

Each model is a Hugging Face-format Qwen3 folder: config.json,
model.safetensors (seeded random fp32 weights until a later issue trains
them), tokenizer.json and tokenizer_config.json (the shared byte tokenizer).

The embedding table has 320 rows while the tokenizer defines 259 ids; the
extra rows are padding (as Qwen pads its vocabulary). Flare never samples or
scores them: the loader sets ``output_vocab_size`` to the tokenizer's size
and programs slice the logits to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ignition.models.byte_tokenizer import SPECIAL_TOKENS, build_byte_tokenizer, write_tokenizer_files
from ignition.models.qwen3 import Qwen3Config

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "ignition" / "models" / "bundled" / "flare-tiny"
SHARED = dict(vocab_size=320, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=True)
TARGET = Qwen3Config(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                     intermediate_size=384, **SHARED)
DRAFT = Qwen3Config(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                    intermediate_size=192, **SHARED)
SEEDS = {"target": 20260, "draft": 20261}


def hf_config(c: Qwen3Config) -> dict:
    tokenizer = build_byte_tokenizer()
    end, pad = (tokenizer.token_to_id(t) for t in (SPECIAL_TOKENS[2], SPECIAL_TOKENS[0]))
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,  # transformers 4.x spelling
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},  # 5.x spelling
        "attention_bias": False,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": end,
        "pad_token_id": pad,
    }


def random_weights(c: Qwen3Config, seed: int) -> dict[str, torch.Tensor]:
    """Norm scales 1, everything else N(0, 0.02), drawn in weight_keys() order."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for key, shape in c.weight_shapes().items():
        if key.endswith("norm.weight"):
            weights[key] = torch.ones(shape)
        else:
            weights[key] = torch.randn(shape, generator=gen) * 0.02
    return weights


def write_model(folder: Path, c: Qwen3Config, seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(c), indent=2) + "\n")
    save_file(random_weights(c, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    for name, config in (("target", TARGET), ("draft", DRAFT)):
        write_model(out / name, config, SEEDS[name])
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
