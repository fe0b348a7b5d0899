"""End-to-end baseline on the bundled model: transformers ``generate`` with static batching against ``flare run``.

    python -m scripts.scheduling_sim.e2e_transformers --url http://127.0.0.1:8000 [--num-prompts 16]
        [--input-len 128] [--output-len 64] [--batch-size 1,4] [--threads 2] [--json OUT]

What a CPU user would reach for without a serving engine (issue 8, item 4):
load the same weights (``ignition/models/bundled/flare-tiny/target``) with
``AutoModelForCausalLM`` and call ``generate`` greedily on fixed-size batches
of the prompt set, one batch after another. The same prompts go to a running
``flare run`` through ``helios.bench`` (every request sent at once, greedy),
and both sides are summarized with the same latency definitions
(``helios.bench.metrics``).

Prompts are slices of CPython's own standard-library sources cut to exactly
``--input-len`` tokens of the bundled tokenizer, so a static batch needs no
padding and both sides see the same token ids.

Static-batching latency, with every request arriving at time 0: a request's
TTFT is when its batch's first generated token exists (as if streamed); its
E2EL is when its batch's ``generate`` returns (static batching hands a batch
back as a whole). Rows stop at the end-of-sequence token on both sides, so
output token counts are printed too.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from helios.bench.datasets import stdlib_sources
from helios.bench.metrics import Distribution

MODEL_DIR = Path(__file__).resolve().parents[2] / "ignition" / "models" / "bundled" / "flare-tiny" / "target"


class E2eError(ValueError):
    """A bad setting; the message names it and what would be accepted."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    ids: tuple[int, ...]  # the text's encoding, exactly the requested length


@dataclass(frozen=True, slots=True)
class RowResult:
    """One request as the client would see it, seconds from the common start."""

    ttft_s: float
    e2el_s: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class SystemResult:
    name: str
    wall_s: float
    rows: tuple[RowResult, ...]

    @property
    def output_tokens(self) -> int:
        return sum(row.output_tokens for row in self.rows)

    def summary(self) -> dict:
        """Output tokens per second over the whole run and the latency distributions in ms."""
        ttft = Distribution.of([row.ttft_s * 1000 for row in self.rows])
        e2el = Distribution.of([row.e2el_s * 1000 for row in self.rows])
        return {"system": self.name, "requests": len(self.rows), "output_tokens": self.output_tokens,
                "wall_s": self.wall_s, "output_throughput": self.output_tokens / self.wall_s,
                "ttft_ms": asdict(ttft), "e2el_ms": asdict(e2el)}


def fixed_length_prompts(tokenizer, sources: list[str], count: int, length: int, seed: int) -> list[Prompt]:
    """``count`` prompts of exactly ``length`` tokens, each cut from a seeded choice of source text.

    A prefix of token ids may not survive decode then encode (a merge across
    the cut), so a cut that does not round-trip is dropped and another source
    drawn; sources shorter than ``length`` tokens are never used.
    """
    if count < 1 or length < 1:
        raise E2eError(f"--num-prompts {count} and --input-len {length}: both must be at least 1")
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for _ in range(count * 20):
        if len(prompts) == count:
            return prompts
        prompt = _cut(tokenizer, rng.choice(sources), length)
        if prompt is not None:
            prompts.append(prompt)
    if len(prompts) == count:
        return prompts
    raise E2eError(f"--input-len {length}: only {len(prompts)} of {count} prompts could be cut to that many tokens; "
                   "try a shorter length")


def _cut(tokenizer, text: str, length: int) -> Prompt | None:
    ids = tokenizer.encode(text).ids
    if len(ids) < length:
        return None
    cut = tokenizer.decode(ids[:length])
    again = tuple(tokenizer.encode(cut).ids)
    return Prompt(cut, again) if len(again) == length else None


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``1,4,8``: positive integers."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise E2eError(f"--batch-size {text!r}: expected positive integers separated by commas, e.g. 1,4")
    return tuple(int(part) for part in parts)


def batches(items: list, size: int) -> list[list]:
    """Consecutive groups of ``size`` (the last may be smaller), in order."""
    return [items[start:start + size] for start in range(0, len(items), size)]


def generated_length(row: list[int], eos: int | None) -> int:
    """Tokens a row produced: up to and including the first end-of-sequence token."""
    return row.index(eos) + 1 if eos is not None and eos in row else len(row)


def run_transformers(model, prompts: list[Prompt], batch_size: int, output_len: int) -> SystemResult:
    """Batches one after another, every request arriving at time 0."""
    import torch

    rows: list[RowResult] = []
    start = time.perf_counter()
    for group in batches(prompts, batch_size):
        steps = _StepClock()
        input_ids = torch.tensor([p.ids for p in group], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=output_len, stopping_criteria=steps.criteria(),
                                 pad_token_id=model.config.pad_token_id)
        done = time.perf_counter() - start
        first = steps.times[0] - start
        for row in out[:, input_ids.shape[1]:].tolist():
            rows.append(RowResult(first, done, generated_length(row, model.config.eos_token_id)))
    return SystemResult(f"transformers b={batch_size}", time.perf_counter() - start, tuple(rows))


class _StepClock:
    """Notes the time after every decoding step (``generate`` asks its stopping criteria once per step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def criteria(self):
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        clock = self

        class Clock(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                clock.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        return StoppingCriteriaList([Clock()])


def run_flare(url: str, prompts: list[Prompt], output_len: int) -> SystemResult:
    """The same prompts through ``helios.bench``, all sent at once, greedy (its default)."""
    from helios.bench.client import Target
    from helios.bench.datasets import DatasetSpec, LengthRange
    from helios.bench.runner import BenchConfig, run_benchmark

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt": p.text, "output_len": output_len}) + "\n" for p in prompts))
        dataset = DatasetSpec(str(path), len(prompts), LengthRange(1, 1), LengthRange(1, 1), 0)
        run = run_benchmark(BenchConfig(Target(url, "completions", ""), dataset))
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise E2eError(f"flare run at {url}: {len(failed)} requests failed, first: {failed[0]}")
    start = min(r.sent for r in run.results)
    rows = tuple(RowResult(r.chunk_times[0] - start, r.chunk_times[-1] - start, r.output_tokens)
                 for r in run.results)
    return SystemResult("flare run", run.summary.duration_s, rows)


def table(results: list[SystemResult]) -> str:
    header = ("system", "requests", "out tokens", "wall s", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
              "E2EL p50 ms", "E2EL p99 ms")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        s = result.summary()
        cells = (s["system"], s["requests"], s["output_tokens"], f"{s['wall_s']:.2f}", f"{s['output_throughput']:.1f}",
                 f"{s['ttft_ms']['median']:.0f}", f"{s['ttft_ms']['p99']:.0f}",
                 f"{s['e2el_ms']['median']:.0f}", f"{s['e2el_ms']['p99']:.0f}")
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def load_model(threads: int):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        sizes = parse_batch_sizes(args.batch_size)
        if args.output_len < 1 or args.threads < 1:
            raise E2eError(f"--output-len {args.output_len} and --threads {args.threads}: both must be at least 1")
        model, tokenizer = load_model(args.threads)
        sources = [path.read_text(errors="replace") for path in stdlib_sources()]
        prompts = fixed_length_prompts(tokenizer, sources, args.num_prompts, args.input_len, args.seed)
        run_transformers(model, prompts[:1], 1, 2)  # first call pays one-time setup; not measured
        results = [run_transformers(model, prompts, size, args.output_len) for size in sizes]
        if args.url:
            results.append(run_flare(args.url, prompts, args.output_len))
    except E2eError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    if args.json:
        document = {"settings": vars(args), "results": [r.summary() for r in results]}
        Path(args.json).write_text(json.dumps(document, indent=2, default=_finite) + "\n")
    return 0


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running flare run (omit to time transformers only)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens, exact")
    parser.add_argument("--output-len", type=int, default=64, help="max new tokens per request")
    parser.add_argument("--batch-size", default="1,4", help="static batch sizes to time, e.g. 1,4,16")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (flare run's --threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures to this file")
    return parser


if __name__ == "__main__":
    sys.exit(main())
