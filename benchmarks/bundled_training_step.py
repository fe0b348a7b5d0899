"""Time one training step of the bundled target (issue 7's calibration): threads x bf16 x torch.compile.

    nice -n 10 .venv/bin/python benchmarks/bundled_training_step.py --threads 1 [--bf16] [--compile]

Prints wall and CPU seconds per step after the first two steps (compilation,
warm caches) and tokens per second. Random tokens: the cost of a step does
not depend on the text.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `scripts` is not an installed package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bundled_model.bpe import train_tokenizer  # noqa: E402
from scripts.bundled_model.models import TARGET_SHAPE, build_model  # noqa: E402
from scripts.bundled_model.train import TokenStream, next_token_loss, train_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 10, 4096)  # only its special-token ids are used
    model = build_model(TARGET_SHAPE.config(4096, 4096), tokenizer, seed=0)
    forward = torch.compile(model) if a.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream, gen = TokenStream(torch.randint(0, 4096, (200_000,))), torch.Generator().manual_seed(0)
    times = []
    for _ in range(a.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        train_step(forward, optimizer, stream.batch(gen, a.batch_size, a.context), next_token_loss, a.bf16)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    steady = times[2:]
    wall = sum(t for t, _ in steady) / len(steady)
    cpu = sum(c for _, c in steady) / len(steady)
    tokens = a.batch_size * a.context
    print(f"threads={a.threads} bf16={a.bf16} compile={a.compile}: first step {times[0][0]:.1f}s; "
          f"steady {wall:.2f}s/step wall, {cpu:.2f}s CPU; {tokens / wall:.0f} tokens/s, {tokens / cpu:.0f} tokens per CPU-s")


if __name__ == "__main__":
    main()
