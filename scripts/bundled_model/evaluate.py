"""Held-out evaluation of the trained pair: loss, draft/target agreement, simulated speculation, Python-ness.

All measurements are greedy (temperature 0) and use held-out files only.
Speculation is simulated exactly: with greedy verification the output is the
target's own greedy continuation, so a round at position i accepts the
draft's longest greedy run that matches that continuation, plus the target's
bonus token.
"""

from __future__ import annotations

import ast
import math
import random
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn

from .corpus import SourceFile

POSITION_BUCKETS = (0, 512, 1024, 2048, 4096)


@dataclass(frozen=True, slots=True)
class EvalSettings:
    context: int  # window length for loss and agreement
    windows: int  # how many held-out windows
    long_windows: int  # windows at the full max_position_embeddings length
    spec_prompts: int
    spec_prompt_tokens: int
    spec_new_tokens: int
    headers: int
    header_context_chars: int
    header_new_tokens: int
    samples: int
    seed: int


@torch.no_grad()
def window_metrics(target: nn.Module, draft: nn.Module, windows: Tensor) -> dict[str, float]:
    """Held-out loss/perplexity of both models and teacher-forced greedy agreement (draft vs target)."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    t_logits, d_logits = target(input_ids=inputs).logits.float(), draft(input_ids=inputs).logits.float()
    t_loss = float(F.cross_entropy(t_logits.flatten(0, 1), labels.flatten()))
    d_loss = float(F.cross_entropy(d_logits.flatten(0, 1), labels.flatten()))
    return {
        "target_loss": t_loss, "target_perplexity": math.exp(t_loss),
        "draft_loss": d_loss, "draft_perplexity": math.exp(d_loss),
        "greedy_agreement": float((t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean()),
        "target_top1_accuracy": float((t_logits.argmax(-1) == labels).float().mean()),
        "tokens": labels.numel(),
    }


@torch.no_grad()
def loss_by_position(model: nn.Module, windows: Tensor) -> dict[str, float]:
    """Mean held-out loss per position range: how far quality holds beyond the training context."""
    logits = model(input_ids=windows[:, :-1]).logits.float()
    losses = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(0)  # [L]
    buckets = {}
    for lo, hi in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:]):
        if lo < len(losses):
            buckets[f"{lo}-{min(hi, len(losses))}"] = float(losses[lo:hi].mean())
    return buckets


def stream_windows(tokens: Tensor, length: int, count: int) -> Tensor:
    """Up to `count` non-overlapping windows of length+1 tokens, spread evenly over the stream."""
    available = len(tokens) // (length + 1)
    if available == 0:
        raise ValueError(f"the held-out stream has {len(tokens)} tokens, fewer than one {length}-token window")
    picks = torch.linspace(0, available - 1, min(count, available)).round().long().unique()
    return torch.stack([tokens[i * (length + 1):(i + 1) * (length + 1)] for i in picks.tolist()])


@torch.no_grad()
def greedy(model: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation with the model's KV cache."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    generated: list[int] = []
    while True:
        generated.append(int(out.logits[0, -1].argmax()))
        if len(generated) == new_tokens:
            return generated
        out = model(input_ids=torch.tensor([generated[-1:]]), use_cache=True, **_cache_argument(out))


def _cache_argument(out) -> dict[str, object]:
    """transformers 5.x names the KV cache ``cache``; 4.x named it ``past_key_values``."""
    if getattr(out, "cache", None) is not None:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


@dataclass(frozen=True, slots=True)
class SpeculationTally:
    rounds: int = 0
    accepted: int = 0
    offered: int = 0

    def add(self, other: SpeculationTally) -> SpeculationTally:
        return SpeculationTally(self.rounds + other.rounds, self.accepted + other.accepted, self.offered + other.offered)

    def summary(self) -> dict[str, float]:
        return {"mean_accepted_length": self.accepted / max(1, self.rounds),
                "acceptance_rate": self.accepted / max(1, self.offered),
                "tokens_per_target_step": (self.accepted + self.rounds) / max(1, self.rounds), "rounds": self.rounds}


def speculate(target: nn.Module, draft: nn.Module, prompt: list[int], new_tokens: int,
              depths: tuple[int, ...]) -> dict[int, SpeculationTally]:
    """Simulated greedy speculation of one prompt at every depth in `depths`."""
    truth = greedy(target, prompt, new_tokens)

    @cache
    def matched(i: int) -> int:  # how many of the draft's greedy tokens from position i the target keeps
        proposal = greedy(draft, prompt + truth[:i], max(depths))
        return next((k for k, (p, t) in enumerate(zip(proposal, truth[i:])) if p != t), min(len(proposal), len(truth) - i))

    return {d: _rounds(matched, new_tokens, d) for d in depths}


def _rounds(matched, new_tokens: int, depth: int) -> SpeculationTally:
    tally, i = SpeculationTally(), 0
    while i < new_tokens:
        offered = min(depth, new_tokens - i)  # no proposals past the generation budget
        accepted = min(matched(i), offered)
        tally = tally.add(SpeculationTally(1, accepted, offered))
        i += accepted + 1  # plus the target's bonus token
    return tally


def speculation_metrics(target: nn.Module, draft: nn.Module, heldout: Tensor, s: EvalSettings) -> dict[str, object]:
    prompts = stream_windows(heldout, s.spec_prompt_tokens - 1, s.spec_prompts)
    totals = {3: SpeculationTally(), 5: SpeculationTally()}
    for prompt in prompts.tolist():
        for depth, tally in speculate(target, draft, prompt, s.spec_new_tokens, tuple(totals)).items():
            totals[depth] = totals[depth].add(tally)
    return {f"D{d}": t.summary() for d, t in totals.items()} | {"prompts": len(prompts)}


@dataclass(frozen=True, slots=True)
class Header:
    path: str
    context: str  # the file text before the def line
    line: str  # the def line, ending at its colon


def function_headers(files: tuple[SourceFile, ...], count: int, seed: int) -> list[Header]:
    """Top-level one-line ``def`` headers of held-out files, a seeded sample."""
    found = [h for f in files for h in _file_headers(f)]
    return random.Random(seed).sample(found, min(count, len(found)))


def _file_headers(f: SourceFile) -> list[Header]:
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError):
        return []
    lines = f.text.splitlines(keepends=True)
    headers = []
    for node in tree.body:
        line = lines[node.lineno - 1].rstrip() if isinstance(node, ast.FunctionDef) else ""
        # one-line header whose colon ends the line (the body starts on the next line)
        if line.startswith("def ") and line.endswith(":") and node.body[0].lineno > node.lineno:
            headers.append(Header(f.path, "".join(lines[:node.lineno - 1]), line))
    return headers


def parses_after_trim(line: str, continuation: str) -> bool:
    """Does header + continuation, cut after its last complete line, parse as Python?"""
    text = line + continuation
    if "\n" not in text:
        return False
    try:
        ast.parse(text[:text.rindex("\n") + 1])
        return True
    except (SyntaxError, ValueError):
        return False


def header_metrics(target: nn.Module, tokenizer: Tokenizer, headers: list[Header], s: EvalSettings,
                   stop_ids: frozenset[int]) -> dict[str, object]:
    """Prompts end at the header's colon: the BPE joins a newline with the next line's indent,
    so a prompt ending in a bare newline would read as the end of the block."""
    parsed, samples = 0, []
    for h in headers:
        prompt = tokenizer.encode(h.context[-s.header_context_chars:] + h.line).ids
        ids = greedy(target, prompt, s.header_new_tokens)
        ids = ids[:next((i for i, t in enumerate(ids) if t in stop_ids), len(ids))]
        continuation = tokenizer.decode(ids)
        parsed += parses_after_trim(h.line, continuation)
        if len(samples) < s.samples:
            samples.append({"file": h.path, "prompt_line": h.line, "continuation": continuation})
    return {"headers": len(headers), "parsed": parsed, "parse_fraction": parsed / max(1, len(headers)),
            "samples": samples}
