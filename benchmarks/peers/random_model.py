"""A Qwen3-0.6B-shaped checkpoint with seeded random weights, and the memory-bandwidth floor of its decode.

    .venv/bin/python -m benchmarks.peers.random_model [--out DIR] [--seed N] [--bandwidth-only]

Issue 22, item 5: the peers comparison where the arithmetic, not the host
loop, dominates. The shape is Qwen3-0.6B's (28 layers, hidden 1024, 16 query
and 8 key/value heads of 128, intermediate 3072, tied embeddings, RoPE theta
1e6); the vocabulary is the bundled tokenizer's 4,096 entries, so all three
servers read the same ids. ``max_position_embeddings`` is 512 (the harness's
context per sequence), which bounds Flare's KV pool without changing any
weight's shape.

Weights come from ``transformers``' own initialisation (normal, std
``initializer_range`` = 0.02; norms at 1) under ``torch.manual_seed(seed)``,
so the same seed writes the same file. One change: the EOS row of the tied
embedding is zeroed, so the EOS logit is always 0 while the largest of the
other 4,095 logits is positive: greedy decoding never stops early and every
request yields its full output length on every server.

The folder is written under the cache (default
``~/.cache/flare-peers/models/qwen3-0.6b-random``), never into the repository;
an existing folder with the same seed is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "ignition" / "models" / "bundled" / "flare-tiny" / "target"
NAME = "qwen3-0.6b-random"
EOS_ID = 2
# Qwen3-0.6B's decoder shape; the vocabulary and context are the harness's.
SHAPE = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
             head_dim=128, intermediate_size=3072, rope_theta=1.0e6, rms_norm_eps=1.0e-6,
             tie_word_embeddings=True, max_position_embeddings=512)
INIT_STD = 0.02


def default_folder() -> Path:
    from benchmarks.peers.systems import default_cache
    return default_cache() / "models" / NAME


def config_dict(vocab_size: int, seed: int, shape: dict = SHAPE) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
            **shape, "hidden_act": "silu", "attention_bias": False, "initializer_range": INIT_STD,
            "rope_parameters": {"rope_type": "default", "rope_theta": shape["rope_theta"]},
            "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": EOS_ID, "pad_token_id": 0,
            "flare_random_seed": seed}


def write(folder: Path, seed: int, shape: dict = SHAPE) -> Path:
    """Write the checkpoint (config, safetensors, the bundled tokenizer); a finished one is kept.

    ``shape`` is Qwen3-0.6B's; tests pass a small one."""
    marker = folder / "config.json"
    if marker.exists() and json.loads(marker.read_text()).get("flare_random_seed") == seed:
        return folder
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]
    spec = config_dict(vocab, seed, shape)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in spec.items() if k != "flare_random_seed"}))
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[EOS_ID].zero_()  # tied: the EOS logit is 0, never the argmax
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, partial / name)
    (partial / "config.json").write_text(json.dumps(spec, indent=2) + "\n")  # our exact config, seed included
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


@dataclass(frozen=True, slots=True)
class Floor:
    """Decode at batch 1 reads every weight once: its bytes over a measured bandwidth, GB/s."""

    weight_bytes: int
    copy_gbs: float  # memcpy convention (bytes copied per second), as issue 22's flare-tiny figure
    read_gbs: float  # a read-only pass (``Tensor.sum``), what a weight-streaming decode step does

    def ms(self, gbs: float) -> float:
        return self.weight_bytes / (gbs * 1e9) * 1e3


def bandwidths(mib: int = 512, repeats: int = 7) -> tuple[float, float]:
    """Best-of ``repeats`` one-thread copy and read bandwidth on buffers far beyond the caches, GB/s."""
    import torch
    torch.set_num_threads(1)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = read = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        middle = time.perf_counter()
        src.sum()
        copy, read = min(copy, middle - start), min(read, time.perf_counter() - middle)
    size = src.numel() * 4
    return size / copy / 1e9, size / read / 1e9


def weight_bytes(folder: Path) -> int:
    from safetensors import safe_open
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 4  # float32
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.random_model", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", type=Path, default=None, help=f"checkpoint folder (default CACHE/models/{NAME})")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before initialisation (default 0)")
    p.add_argument("--bandwidth-only", action="store_true", help="only measure the copy bandwidth and the floor")
    args = p.parse_args(argv)
    folder = (args.out or default_folder()).expanduser()
    if REPO.resolve() in folder.resolve().parents:
        print(f"error: --out {folder}: inside the repository; the checkpoint belongs in a cache folder",
              file=sys.stderr)
        return 2
    if not args.bandwidth_only:
        start = time.perf_counter()
        write(folder, args.seed)
        print(f"checkpoint: {folder} ({time.perf_counter() - start:.1f} s)")
    if not (folder / "config.json").exists():
        print(f"error: {folder}: no checkpoint there (run without --bandwidth-only first)", file=sys.stderr)
        return 2
    floor = Floor(weight_bytes(folder), *bandwidths())
    print(f"weights: {floor.weight_bytes / 1e6:.1f} MB; 1 thread: copy {floor.copy_gbs:.1f} GB/s -> decode floor "
          f"at batch 1 {floor.ms(floor.copy_gbs):.1f} ms; read {floor.read_gbs:.1f} GB/s -> "
          f"{floor.ms(floor.read_gbs):.1f} ms (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
