"""One training phase under a time budget: AdamW, warm-up then cosine decay, random windows.

A phase given ``steps`` is exactly reproducible from the seed. A phase given
only ``minutes`` times its warm-up steps, then fixes the step count that fits
the rest of the budget, so its learning-rate schedule still ends where it
should; the summary records that count, and rerunning with ``--*-steps``
reproduces the run bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Objective = Callable[[Tensor, Tensor, Tensor], Tensor]  # (logits, inputs, targets) -> loss
TIMING_SKIPPED_STEPS = 3  # the first steps include torch.compile's compilation


@dataclass(frozen=True, slots=True)
class PhaseSettings:
    minutes: float
    steps: int | None  # fixed step count; None = as many as fit in `minutes`
    context: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    seed: int
    bf16: bool
    compile: bool


@dataclass(frozen=True, slots=True)
class PhaseReport:
    steps: int
    tokens: int
    seconds: float
    tokens_per_second: float
    final_train_loss: float  # mean over the last steps
    steady_tokens_per_second: float  # after the first steps (compilation, warm caches)


class TokenStream:
    """The training tokens as one long sequence; a batch is random windows of it."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens = tokens  # int64 [N]

    def batch(self, gen: torch.Generator, batch_size: int, context: int) -> tuple[Tensor, Tensor]:
        if len(self.tokens) <= context + 1:
            raise ValueError(f"the training stream has {len(self.tokens)} tokens, fewer than a {context}-token window")
        starts = torch.randint(0, len(self.tokens) - context - 1, (batch_size,), generator=gen)
        windows = torch.stack([self.tokens[s:s + context + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]


def next_token_loss(logits: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def distillation_loss(teacher: nn.Module, bf16: bool) -> Objective:
    """KL(teacher || student) per position: the draft learns the target's whole distribution."""
    def loss(logits: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        with torch.no_grad(), autocast(bf16):
            teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
        student_logp = F.log_softmax(logits.float(), dim=-1)
        return F.kl_div(student_logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True, reduction="batchmean")
    return loss


def autocast(bf16: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def learning_rate(s: PhaseSettings, step: int, total: int | None) -> float:
    if step < s.warmup_steps or total is None:
        return s.learning_rate * min(1.0, (step + 1) / s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


def train_phase(model: nn.Module, stream: TokenStream, s: PhaseSettings, objective: Objective,
                log: Callable[[str], None]) -> PhaseReport:
    gen = torch.Generator().manual_seed(s.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    forward = torch.compile(model) if s.compile else model
    model.train()
    clock = _Clock(s)
    total, losses, step = s.steps, [], 0
    while total is None or step < total:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(s, step, total)
        losses.append(train_step(forward, optimizer, stream.batch(gen, s.batch_size, s.context), objective, s.bf16))
        step += 1
        clock.tick(step)
        total = total if total is not None else clock.fix_total(step)
        if step % 50 == 0 or step == total:
            log(f"step {step}/{total or '?'} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                f"{clock.elapsed():.0f}s")
    model.eval()
    tail = losses[-max(1, min(50, len(losses) // 5)):]
    tokens = step * s.batch_size * s.context
    steady = clock.seconds_per_step() or clock.elapsed() / step
    return PhaseReport(step, tokens, clock.elapsed(), tokens / clock.elapsed(), sum(tail) / len(tail),
                       s.batch_size * s.context / steady)


def train_step(forward: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor],
          objective: Objective, bf16: bool) -> float:
    inputs, targets = batch
    with autocast(bf16):
        logits = forward(input_ids=inputs).logits
    loss = objective(logits, inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(forward.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


class _Clock:
    """Wall time of a phase, and the step count that fits its budget once warm-up is timed."""

    def __init__(self, s: PhaseSettings) -> None:
        self.settings, self.start = s, time.perf_counter()
        self.timed_from: tuple[int, float] | None = None
        self.last = (0, 0.0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def tick(self, step: int) -> None:
        if step == TIMING_SKIPPED_STEPS:
            self.timed_from = (step, self.elapsed())
        self.last = (step, self.elapsed())

    def seconds_per_step(self) -> float | None:
        if self.timed_from is None or self.last[0] == self.timed_from[0]:
            return None
        return (self.last[1] - self.timed_from[1]) / (self.last[0] - self.timed_from[0])

    def fix_total(self, step: int) -> int | None:
        per_step = self.seconds_per_step()
        if step < max(self.settings.warmup_steps, TIMING_SKIPPED_STEPS + 2) or per_step is None:
            return None
        remaining = self.settings.minutes * 60 - self.elapsed()
        return step + max(0, int(remaining / per_step))
