"""Where a frame's time goes at batch 1: the program against the engine's Python work around it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/host_loop.py CATALOG [--threads 1] [--tokens 64]
        [--requests 8] [--speculation off] [--frame-slots 2] [--switch-interval-ms MS] [--cpu | --totals]

Runs ``--requests`` greedy requests one after another (batch 1, no HTTP)
through ``HeliosEngine`` on a captured catalog (``compile: aoti`` catalogs are
loaded trusted, as ``flare run`` loads its own bundled one), after one untimed
request. The engine's methods are wrapped with timers, so the figures are the
control thread's and the device worker's own work, not estimates:

- ``program``: the program call itself (``Executor._timed_call``), the
  reference every other line is a share of;
- ``executor around the call``: the rest of ``Executor.call`` on the device
  worker (input moves, the program wrapper);
- control thread: ``read`` (``Executor.finish``: reading the outputs and the
  completion records, which the worker hands over unread), ``plan``
  (``Scheduler.plan`` with ``advance_to``), ``bind``
  (page reservation, page-table rows, row packing), ``commit``, ``complete``
  (``Scheduler.complete*``), ``publish`` (detokenisation, stop strings,
  handing the delta to the request's outbox), ``wake`` (handing the step's
  outboxes to the waker thread once per control step, after the step submitted
  its next frame; the waker wakes the event loop, whose turn then overlaps that
  frame's program), and ``other`` (the rest of the
  control loop's counted time: event handling, admission, retirement).

SSE writes happen in the HTTP server's event loop, outside the engine; they are
not in these figures.

``--totals`` leaves the per-part timers out (each timed call costs a few
microseconds of its own, counted in its part): it reads the engine's own
control-step time (``frame_counters().host_ns``) and program time
(``device_ns``), times only ``Executor.call`` for the worker's work around the
call, and gives the control thread's CPU time per frame beside them (the
whole thread: its waits for events cost CPU too).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from collections import defaultdict
from functools import wraps

from helios.catalog.load import load
from helios.runtime import engine as engine_module
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import GenerationRequest, SamplingParams
from helios.runtime.executor import Executor
from helios.scheduler.core import Scheduler
from helios.runtime.state_ops import STATE_KINDS

STATE_KIND_VALUES = frozenset(kind.value for kind in STATE_KINDS)

TOTALS: dict[str, int] = defaultdict(int)
CPU: dict[str, int] = defaultdict(int)  # --cpu: the calling thread's CPU time per part
COUNTS: dict[str, int] = defaultdict(int)
CLOCKS = {"cpu": False}  # --cpu sets it (each timed call then also reads the thread's CPU clock)
PROFILED: dict[str, cProfile.Profile] = {}  # --profile: label -> the profile of that part's calls


def _timed(owner, name: str, label: str) -> None:
    """Replace ``owner.name`` with a wrapper adding its run time to ``TOTALS[label]``."""
    inner = getattr(owner, name)

    @wraps(inner)
    def wrapper(*args, **kwargs):
        profile = PROFILED.get(label)
        cpu = CLOCKS["cpu"]
        began, began_cpu = time.perf_counter_ns(), time.thread_time_ns() if cpu else 0
        try:
            if profile is not None:
                return profile.runcall(inner, *args, **kwargs)
            return inner(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter_ns() - began
            if cpu:
                CPU[label] += time.thread_time_ns() - began_cpu
            COUNTS[label] += 1

    setattr(owner, name, wrapper)


def _instrument() -> None:
    _timed(Executor, "_timed_call", "program")
    _timed(Executor, "call", "executor.call")
    _timed(Executor, "finish", "read")
    for name in ("plan", "advance_to"):
        _timed(Scheduler, name, "plan")
    _timed(Scheduler, "commit", "commit")
    for name in ("complete", "complete_with_survival", "complete_packed_round",
                 "complete_packed_round_with_survival"):
        _timed(Scheduler, name, "complete")
    _timed(engine_module.HeliosEngine, "_bind", "bind")
    _timed(engine_module.HeliosEngine, "_publish", "publish")
    _timed(engine_module.HeliosEngine, "_step", "step")  # the control step's own work, for --cpu's "other"
    if hasattr(engine_module.HeliosEngine, "_wake_listeners"):  # absent before deliveries were deferred
        _timed(engine_module.HeliosEngine, "_wake_listeners", "wake")


async def _request(engine: HeliosEngine, rid: str, tokens: int) -> int:
    prompt = tuple(engine.tokenizer.encode(f"def request_{rid}(value):\n    return", add_special_tokens=True))
    request = GenerationRequest(rid, prompt, tokens, SamplingParams(temperature=0.0), ignore_eos=True)
    return sum([len(d.token_ids) async for d in engine.submit(request)])


def _state_ns(before, after) -> int:
    """Device time of state programs (snapshots, restores) between two counter copies: they run through
    ``Executor.run_state``, not ``Executor.call``."""
    return sum(after.executions[k][1] - before.executions.get(k, (0, 0))[1] for k in after.executions
               if k[0] in STATE_KIND_VALUES)


def _report(host_ns: int, frames: int, produced: int, seconds: float, state_ns: int = 0) -> None:
    program = TOTALS["program"]
    around = TOTALS["executor.call"] - (program - state_ns)
    control = ("read", "plan", "commit", "complete", "bind", "publish", "wake")
    other = host_ns - sum(TOTALS[k] for k in control)
    print(f"{frames} frames, {produced} tokens in {seconds:.2f} s ({produced / seconds:.1f} tok/s); "
          f"program {program / 1e6 / frames:.3f} ms/frame")
    rows = [("executor around the call", around)] + [(k, TOTALS[k]) for k in control] + [("other", other)]
    cpu = None
    if CLOCKS["cpu"]:  # the same parts in the thread's CPU time: what is left once waits are taken out
        parts = ("read", "plan", "commit", "complete", "bind", "publish")
        cpu = {"executor around the call": CPU["executor.call"] - (CPU["program"] - state_ns), "wake": CPU["wake"],
               "other": CPU["step"] - sum(CPU[k] for k in parts), **{k: CPU[k] for k in parts}}
        print(f"  {'':26s} {'wall':>8s}                           {'cpu':>8s}")
    for label, ns in rows:
        line = f"  {label:26s} {ns / 1e3 / frames:8.1f} us/frame  {100 * ns / program:5.1f}% of program"
        if cpu is not None:
            line += f"  {cpu[label] / 1e3 / frames:8.1f} us/frame  {100 * cpu[label] / program:5.1f}%"
        print(line)
    host = around + host_ns
    line = f"  {'host total':26s} {host / 1e3 / frames:8.1f} us/frame  {100 * host / program:5.1f}% of program"
    if cpu is not None:
        total = sum(cpu.values())
        line += f"  {total / 1e3 / frames:8.1f} us/frame  {100 * total / program:5.1f}%"
    print(line)


def _thread_clocks() -> dict[str, int]:
    """The control thread's CPU clock (``time.pthread_getcpuclockid``), by thread name."""
    import threading

    return {t.name: time.pthread_getcpuclockid(t.ident) for t in threading.enumerate() if t.name == "helios-control"}


def _report_totals(before, after, clocks: dict[str, int], cpu_before: dict[str, int], produced: int,
                   seconds: float) -> None:
    frames = after.frames - before.frames
    program, control = after.device_ns - before.device_ns, after.host_ns - before.host_ns
    around = TOTALS["executor.call"] - (program - _state_ns(before, after))
    cpu = {name: time.clock_gettime_ns(clock) - cpu_before[name] for name, clock in clocks.items()}
    print(f"{frames} frames, {produced} tokens in {seconds:.2f} s ({produced / seconds:.1f} tok/s); "
          f"program {program / 1e6 / frames:.3f} ms/frame; {(after.plans - before.plans) / frames:.2f} plans/frame")
    for label, ns in (("control steps (wall)", control), ("executor around the call (wall)", around),
                      ("host total (wall)", control + around)):
        print(f"  {label:34s} {ns / 1e3 / frames:8.1f} us/frame  {100 * ns / program:5.1f}% of program")
    if "helios-control" in cpu:
        ns = cpu["helios-control"]
        print(f"  {'control thread, CPU':34s} {ns / 1e3 / frames:8.1f} us/frame  {100 * ns / program:5.1f}% of program")


async def _run(args) -> None:
    catalog = load(args.catalog, trust=True)
    switch = {} if args.switch_interval_ms is None else {"switch_interval_s": args.switch_interval_ms / 1e3}
    config = EngineConfig(threads=args.threads, speculation=args.speculation, frame_slots=args.frame_slots, **switch)
    engine = HeliosEngine(catalog, config)
    engine.warm_up()
    await engine.start()
    try:
        await _request(engine, "warm", args.tokens)
        TOTALS.clear()
        CPU.clear()
        COUNTS.clear()
        clocks = _thread_clocks()
        cpu_before = {name: time.clock_gettime_ns(clock) for name, clock in clocks.items()}
        before = engine.frame_counters()
        began = time.perf_counter()
        produced = 0
        for i in range(args.requests):
            produced += await _request(engine, str(i), args.tokens)
        seconds = time.perf_counter() - began
        after = engine.frame_counters()
        if args.totals:
            _report_totals(before, after, clocks, cpu_before, produced, seconds)
    finally:
        await engine.stop()
    if not args.totals:
        _report(after.host_ns - before.host_ns, after.frames - before.frames, produced, seconds,
                _state_ns(before, after))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("catalog")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--speculation", default="off", choices=("off", "fixed", "adaptive"))
    parser.add_argument("--frame-slots", type=int, default=2)
    parser.add_argument("--profile", default="", help="comma-separated parts (bind, publish, ...) to profile "
                                                      "with cProfile; prints their top functions (slower)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the engine's GIL switch interval (EngineConfig.switch_interval_s; default its own)")
    parser.add_argument("--cpu", action="store_true", help="also give each part's thread CPU time (beside the "
                                                            "wall time: the difference is waiting for a core or the GIL)")
    parser.add_argument("--totals", action="store_true", help="no per-part timers: the engine's own counters, "
                                                               "Executor.call and each thread's CPU time")
    args = parser.parse_args()
    if args.totals and (args.cpu or args.profile):
        parser.error("--totals leaves the per-part timers out: it takes neither --cpu nor --profile")
    CLOCKS["cpu"] = args.cpu
    if args.totals:
        _timed(Executor, "call", "executor.call")
    else:
        _instrument()
    for label in filter(None, args.profile.split(",")):
        PROFILED[label] = cProfile.Profile()
    asyncio.run(_run(args))
    for label, profile in PROFILED.items():
        print(f"--- {label}: top functions by own time")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
