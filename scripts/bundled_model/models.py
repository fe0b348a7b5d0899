"""Model shapes, building a trainable Qwen3 and writing it as a Hugging Face folder.

Training uses transformers' ``Qwen3ForCausalLM``: Flare's own decoder
(``ignition.models.qwen3``) runs only over the paged KV cache through custom
ops without autograd, while transformers' module trains as is and its
parameter names are the checkpoint names the runtime loads. The saved
tensors are exactly ``ignition.models.qwen3.Qwen3Config.weight_keys()``, so
``load_checkpoint`` reads the folder by the same contract as any checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from ignition.models.qwen3 import Qwen3Config

from .bpe import END_OF_TEXT, END_OF_TURN, write_tokenizer


class ShapeError(ValueError):
    """A --target-shape / --draft-shape string that does not parse."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int

    def with_overrides(self, spec: str) -> ModelShape:
        """``"layers=2,hidden=128"``: named fields replaced, the rest kept."""
        names = {f.name for f in fields(self)}
        changes = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if key not in names or not value.strip().isdigit() or int(value) < 1:
                raise ShapeError(f"shape item {item!r}: expected NAME=POSITIVE_INT with NAME in {sorted(names)}")
            changes[key] = int(value)
        return replace(self, **changes)

    def config(self, vocab_size: int, max_positions: int) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=vocab_size, hidden_size=self.hidden, num_layers=self.layers, num_heads=self.heads,
            num_kv_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=self.ffn,
            rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=max_positions,
            tie_word_embeddings=True,
        )


# The calibration shapes: a 7.9M-parameter target (at 4096 tokens) and a 5x smaller draft.
TARGET_SHAPE = ModelShape(layers=4, hidden=384, heads=6, kv_heads=2, head_dim=64, ffn=1024)
DRAFT_SHAPE = ModelShape(layers=2, hidden=192, heads=3, kv_heads=1, head_dim=64, ffn=512)


def parameter_count(config: Qwen3Config) -> int:
    return sum(torch.Size(shape).numel() for shape in config.weight_shapes().values())


SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_config(config: Qwen3Config, tokenizer: Tokenizer, dtype: str = "float32") -> dict[str, object]:
    """config.json in both transformers spellings of RoPE (4.x ``rope_theta``, 5.x ``rope_parameters``)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": config.attention_bias,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": tokenizer.token_to_id(END_OF_TURN),
        "pad_token_id": tokenizer.token_to_id(END_OF_TEXT),
    }


def build_model(config: Qwen3Config, tokenizer: Tokenizer, seed: int) -> transformers.Qwen3ForCausalLM:
    """A freshly initialised model; the seed fixes its weights."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3Config.from_dict(hf_config(config, tokenizer))
    hf._attn_implementation = "sdpa"
    return transformers.Qwen3ForCausalLM(hf).float()


def round_weights(model: nn.Module, dtype: str) -> None:
    """Round the trained fp32 weights to the stored dtype in place, so evaluation measures what ships."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(SAVE_DTYPES[dtype]).float())


def save_model(folder: Path, model: transformers.Qwen3ForCausalLM, config: Qwen3Config,
               tokenizer: Tokenizer, dtype: str) -> None:
    """config.json, model.safetensors (the loader's key set, in `dtype`) and the tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    weights = {key: state[key].detach().to(SAVE_DTYPES[dtype]).contiguous() for key in config.weight_keys()}
    (folder / "config.json").write_text(json.dumps(hf_config(config, tokenizer, dtype), indent=2) + "\n")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder, tokenizer, config.max_position_embeddings)


def shape_summary(shape: ModelShape, config: Qwen3Config) -> dict[str, object]:
    return {**asdict(shape), "parameters": parameter_count(config)}
