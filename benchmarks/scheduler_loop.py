"""The scheduler's own work per frame, driven as the engine drives it, without a device.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scheduler_loop.py CATALOG [--streams 1] [--requests 40]
        [--tokens 64] [--dump FILE]

Loads a captured catalog's descriptors (no program is loaded: any catalog,
compiled or not), keeps the programs ``flare run --speculation off`` keeps, and
runs ``Scheduler`` on a synthetic clock the way ``HeliosEngine`` calls it:
``--streams`` requests resident at a time (12 prompt tokens, ``--tokens``
greedy output each) until ``--requests`` have finished; up to two frames
queued; each completion after a program time of 2.8 ms +-0.3 ms (seeded) plus
20 us per prompt token and 0.15 ms of host time, then ``published_output``
for every request that got a token. It prints ``plan`` (with ``advance_to``),
``commit`` and ``complete`` per frame in this thread's CPU time (the wall
clock on a shared machine mostly measures waiting for a core), beside the
engine's real figures in ``benchmarks/host_loop.py``.

The clock is synthetic and the order of calls fixed, so two versions of the
scheduler that decide alike print the same plans: ``--dump FILE`` writes every
``plan()`` call (graph, lanes, reason, duration estimate, score, A12 trace) as
one JSON line, and a restructuring compares two files with ``cmp`` (like
``plan_bench.py --dump``, on a real catalog's graphs and at batch 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: a tree named there is the one measured

from helios.catalog.load import load  # noqa: E402
from helios.runtime.engine import select_programs  # noqa: E402
from helios.scheduler.core import Scheduler  # noqa: E402
from helios.scheduler.types import AdmitRequest, CompletionRecord, ExecutionTiming, LanePhase  # noqa: E402

PROGRAM_NS, JITTER_NS, PER_PROMPT_TOKEN_NS, HOST_NS = 2_800_000, 300_000, 20_000, 150_000
PROMPT_TOKENS = 12
PARTS = ("plan", "commit", "complete")


class Loop:
    """One run: the scheduler, the synthetic clock, the queued frames and the CPU time of each part."""

    def __init__(self, scheduler: Scheduler, dump=None) -> None:
        self.scheduler, self.dump = scheduler, dump
        self.now, self.fence, self.calls, self.frames = 0, 0, 0, 0
        self.queued: list[tuple[int, object, int]] = []  # (fence, plan, expected end)
        self.cpu_ns = dict.fromkeys(PARTS, 0)
        self.random = random.Random(1)

    def timed(self, part: str, call, *args):
        began = time.thread_time_ns()
        try:
            return call(*args)
        finally:
            self.cpu_ns[part] += time.thread_time_ns() - began

    def fill(self) -> None:
        """The engine's ``_fill_frames``: plan and commit while a frame slot is free and a plan comes."""
        sched = self.scheduler
        while len(sched.queued_fences) < 2:
            plan = self.timed("plan", lambda: (sched.advance_to(self.now), sched.plan())[1])
            if self.dump is not None:
                self.dump.write(_record(self.calls, plan) + "\n")
            self.calls += 1
            if plan is None:
                return
            self.fence += 1
            self.timed("commit", sched.commit, plan, self.fence)
            prompt = sum(lane.prompt_tokens for lane in plan.lanes)
            start = max([end for _, _, end in self.queued] + [self.now])
            took = PROGRAM_NS + self.random.randrange(-JITTER_NS, JITTER_NS) + PER_PROMPT_TOKEN_NS * prompt
            self.queued.append((self.fence, plan, start + took))

    def finish_oldest(self) -> list:
        fence, plan, end = self.queued.pop(0)
        self.now = max(self.now, end) + HOST_NS
        self.scheduler.advance_to(self.now)
        records = [CompletionRecord(lane.handle, prompt_consumed=lane.prompt_tokens,
                                    tokens=(7,) if lane.finishes_prompt else ())
                   if lane.phase is LanePhase.PROMPT else CompletionRecord(lane.handle, tokens=(7,))
                   for lane in plan.lanes]
        took = end - self.now + PROGRAM_NS
        self.frames += 1
        return self.timed("complete", self.scheduler.complete, fence, records, ExecutionTiming(took, took))


def _record(call: int, plan) -> str:
    found = None if plan is None else {
        "graph": plan.graph.id, "lanes": [dataclasses.asdict(lane) for lane in plan.lanes],
        "reason": plan.reason.value, "estimated_duration_ns": plan.estimated_duration_ns,
        "scaled_value_rate": plan.scaled_value_rate, "log_scale": plan.log_scale,
        "prefill_row": plan.prefill_row, "requires_feedback": plan.requires_feedback,
        "trace": None if plan.trace is None else dataclasses.asdict(plan.trace)}
    return json.dumps({"call": call, "plan": found}, default=str, sort_keys=True)


def run(catalog_path: str, streams: int, requests: int, tokens: int, dump=None) -> Loop:
    catalog = load(catalog_path, trust=True)  # descriptors only: no program is materialized
    graphs = select_programs(catalog.descriptors, "off")
    loop = Loop(Scheduler(graphs, request_slots=catalog.state.layout["request_slots"], speculation="off"), dump)
    sched, waiting, active = loop.scheduler, requests, set()
    while waiting or active or loop.queued:
        while waiting and len(active) < streams:
            sched.advance_to(loop.now)
            active.add(sched.admit(AdmitRequest(prompt_tokens=PROMPT_TOKENS, max_tokens=tokens, context_limit=4096)))
            waiting -= 1
        loop.fill()
        if not loop.queued:
            break
        for token in loop.finish_oldest():
            if token.finished:
                active.discard(token.handle)
            else:
                sched.published_output(token.handle, token.fence)
    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("catalog")
    parser.add_argument("--streams", type=int, default=1, help="requests resident at once")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dump", type=Path, default=None, metavar="FILE",
                        help="write every plan() decision as a JSON line (compare two versions with cmp)")
    args = parser.parse_args()
    dump = None if args.dump is None else args.dump.open("w")
    try:
        loop = run(args.catalog, args.streams, args.requests, args.tokens, dump)
    finally:
        if dump is not None:
            dump.close()
    frames = max(loop.frames, 1)
    print(f"{loop.frames} frames, {loop.calls} plan calls ({args.streams} streams); CPU time per frame:")
    for part in PARTS:
        print(f"  {part:9s} {loop.cpu_ns[part] / 1e3 / frames:7.1f} us")
    print(f"  {'total':9s} {sum(loop.cpu_ns.values()) / 1e3 / frames:7.1f} us")


if __name__ == "__main__":
    main()
