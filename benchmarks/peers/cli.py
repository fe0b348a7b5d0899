"""The harness's command line: install, start, check, warm up, measure (interleaved), print the table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.peers import dataset, install, plan, servers, systems, table
from benchmarks.peers.install import say
from benchmarks.peers.systems import HarnessError, Layout, Settings

REPO = Path(__file__).resolve().parents[2]
# Every target shares the bundled tokenizer (the generated 0.6B model copies it), so one dataset fits all.
TOKENIZER = REPO / "ignition" / "models" / "bundled" / "flare-tiny" / "target" / "tokenizer.json"
# The `flare` beside the interpreter running the harness: the project's .venv when run as documented, and
# still the right one from a git worktree without its own .venv (PYTHONPATH then picks the worktree's code,
# and the servers and clients inherit it).
FLARE = Path(sys.executable).with_name("flare")
IGNITION = FLARE.with_name("ignition")
WARMUP = plan.Cell(16, concurrency=16)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description="Flare beside vLLM's CPU backend and llama.cpp's llama-server on one target (--model): "
                    "installs the peers into their own environments under --cache, starts every server "
                    "with 1 thread, 16 sequences, the same context and seed, greedy; checks output lengths and "
                    "greedy text; runs `flare bench` at concurrency 1, 4, 16 and one Poisson rate, systems "
                    "interleaved over repetitions; prints medians with ratios to Flare. docs/benchmarks.md.")
    p.add_argument("--quick", action="store_true", help="one repetition and fewer prompts per cell")
    p.add_argument("--model", choices=systems.TARGET_NAMES, default="flare-tiny",
                   help="what every system serves: the bundled flare-tiny target (default), or a Qwen3-0.6B-shaped "
                        "checkpoint of seeded random weights, generated and captured under --cache on first use")
    p.add_argument("--cache", type=Path, default=systems.default_cache(),
                   help="where peers are installed and built (default $FLARE_PEERS_CACHE or ~/.cache/flare-peers)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {', '.join(systems.SYSTEM_NAMES)} (default all; without "
                        "flare-adaptive for a model with no draft, where asking for it is refused)")
    p.add_argument("--repetitions", type=int, default=None, help="interleaved repetitions (default 3; --quick 1)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrival rate of the open-loop cell, requests/s "
                   "(default 2 for flare-tiny, 0.25 for qwen3-0.6b-random)")
    p.add_argument("--gguf-type", choices=("f32", "f16"), default="f32", help="llama.cpp weights (no quantisation)")
    p.add_argument("--flare-catalog", type=Path, default=None,
                   help="serve Flare from this already captured catalog (loaded with --trust-catalog) instead of "
                        "the bundled default or the harness's own capture of --model; it must be a catalog of the "
                        "same model, since the greedy texts are compared")
    p.add_argument("--check-prompts", type=int, default=2, help="prompts whose greedy text is compared across systems")
    p.add_argument("--out", type=Path, default=None, help="folder for the dataset, bench JSON and the table "
                   "(default CACHE/runs/DATE)")
    return p


@dataclass(slots=True)
class Session:
    """One harness run: its settings, where it writes, the servers up, and what it found."""

    settings: Settings
    layout: Layout
    model: systems.Target
    out: Path
    names: list[str]
    results: table.Results
    up: dict[str, servers.Server] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    idle_cores: float = 0.0  # what the servers up burn together while nobody asks (``_idle_check``)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        session = _session(args)
        _run(session, args)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _session(args: argparse.Namespace) -> Session:
    layout = Layout(args.cache)
    model = systems.target(args.model, layout, REPO)
    if args.flare_catalog is not None:
        if not (args.flare_catalog / "catalog.yaml").is_file():
            raise HarnessError(f"--flare-catalog {args.flare_catalog}: no catalog.yaml there "
                               "(give the folder `ignition capture --out` wrote)")
        model = replace(model, catalog=args.flare_catalog.resolve())
    names = [n.strip() for n in (args.systems or ",".join(systems.default_systems(model))).split(",") if n.strip()]
    if unknown := [n for n in names if n not in systems.SYSTEM_NAMES]:
        raise HarnessError(f"--systems: unknown {', '.join(unknown)}; expected some of {', '.join(systems.SYSTEM_NAMES)}")
    if args.repetitions is not None and args.repetitions < 1:
        raise HarnessError(f"--repetitions {args.repetitions}: at least 1")
    if args.rate is not None and not args.rate > 0:
        raise HarnessError(f"--rate {args.rate}: a positive number of requests per second")
    systems.check_cache(args.cache, REPO, (REPO / ".venv", Path(sys.prefix)))
    if not FLARE.exists():
        raise HarnessError(f"{FLARE} is missing: run `make install` first (flare bench is the client)")
    if "flare-adaptive" in names and not model.has_draft:
        raise HarnessError(f"--systems flare-adaptive: the {model.name} model has no draft to speculate with; "
                           "leave it out (e.g. --systems flare-off,vllm,llama.cpp)")
    settings = Settings(gguf_type=args.gguf_type)
    out = args.out or args.cache / "runs" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return Session(settings, layout, model, out, names, table.Results(settings.input_len, settings.output_len))


def _run(session: Session, args: argparse.Namespace) -> None:
    cells = plan.cells(args.quick, args.rate or session.model.default_rate)
    repetitions = args.repetitions or (1 if args.quick else 3)
    data = session.out / "prompts.jsonl"
    count = max(c.num_prompts for c in [*cells, WARMUP])
    prompts = dataset.build(TOKENIZER, data, count, session.settings.input_len,
                            session.settings.output_len, session.settings.seed)
    say(f"dataset: {count} prompts of exactly {session.settings.input_len} tokens, "
        f"{session.settings.output_len} output tokens each ({data})")
    _install(session)
    try:
        _start_all(session)
        _check_all(session, prompts[: args.check_prompts])
        _idle_check(session)
        _measure(session, cells, repetitions, data)
    finally:
        for server in session.up.values():
            servers.stop(server)
    _report(session, args, cells, repetitions)


def _install(session: Session) -> None:
    base = getattr(sys, "_base_executable", sys.executable)
    # The model first: every system needs it, so its failure stops the run (HarnessError propagates).
    install.run_steps("model", systems.model_steps(session.model, sys.executable, IGNITION, REPO), session.layout.logs)
    wanted = {"vllm": lambda: systems.vllm_steps(session.layout, base),
              "llama.cpp": lambda: systems.llama_steps(session.layout, base, session.model, session.settings.gguf_type)}
    for name, steps in wanted.items():
        if name in session.names:
            try:
                install.run_steps(name, steps(), session.layout.logs)
            except HarnessError as exc:
                session.results.unavailable[name] = f"not installed: {exc}"
                say(f"{name}: NOT INSTALLED: {exc}")


def _spec(session: Session, name: str, port: int) -> systems.ServerSpec:
    if name.startswith("flare"):
        return systems.flare_server(name, FLARE, session.settings, port, session.model)
    if name == "vllm":
        return systems.vllm_server(session.layout, session.model, session.settings, port)
    return systems.llama_server(session.layout, session.settings, port, session.model)


def _start_all(session: Session) -> None:
    for name in session.names:
        if name in session.results.unavailable:
            continue
        port = servers.free_port()
        try:
            session.up[name] = servers.start(_spec(session, name, port), port, session.out / f"{name}-server.log")
        except HarnessError as exc:
            session.results.unavailable[name] = f"did not start: {exc}"
            say(f"{name}: DID NOT START: {exc}")


def _check_all(session: Session, prompts: list[str]) -> None:
    """Full lengths on every server; greedy text compared with the first server up (Flare when it is)."""
    reference: tuple[str, list[servers.Completion]] | None = None
    for name, server in list(session.up.items()):
        try:
            done = servers.check(server, prompts, session.settings)
        except HarnessError as exc:
            session.results.unavailable[name] = f"failed the check: {exc}"
            servers.stop(session.up.pop(name))
            continue
        if reference is None:
            reference = (name, done)
            continue
        for number, (mine, theirs) in enumerate(zip(done, reference[1]), 1):
            session.notes.append(f"greedy text, check prompt {number}, {name} against {reference[0]}: "
                                 + _agreement(mine.text, theirs.text))


def _agreement(a: str, b: str) -> str:
    if a == b:
        return "identical"
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"differs from character {first} of {max(len(a), len(b))} ({a[first:first + 20]!r} vs {b[first:first + 20]!r})"


def _idle_check(session: Session, seconds: float = 3.0) -> None:
    """Servers wait side by side; one that burns CPU while idle would tax the one being measured."""
    before = {n: servers.group_cpu_seconds(s.process.pid) for n, s in session.up.items()}
    time.sleep(seconds)
    for name, server in session.up.items():
        share = (servers.group_cpu_seconds(server.process.pid) - before[name]) / seconds
        session.idle_cores += share
        session.notes.append(f"idle CPU of {name} while waiting: {100 * share:.0f}% of one core")


def _all_cpu_seconds(session: Session) -> float:
    return sum(servers.group_cpu_seconds(s.process.pid) for s in session.up.values())


def _measure(session: Session, cells: list[plan.Cell], repetitions: int, data: Path) -> None:
    load_before = os.getloadavg()[0]
    for name, server in session.up.items():
        say(f"{name}: warm-up pass ({WARMUP.num_prompts} prompts at concurrency {WARMUP.concurrency}, not timed)")
        _bench(server, WARMUP, data, session.out / f"warmup-{name}.json", session.settings.seed)
    runs = plan.schedule(list(session.up), cells, repetitions)
    waits = []
    for number, run in enumerate(runs, 1):
        server = session.up[run.system]
        if run.system in session.results.unavailable:
            continue
        # what the last run left behind (a server still busy after its responses) must not tax this one
        waits.append(servers.wait_quiet(lambda: _all_cpu_seconds(session), session.idle_cores))
        out = session.out / f"rep{run.repetition + 1}-{run.cell.key.replace('/', '')}-{run.system}.json"
        try:
            cpu_before, wall_before = servers.group_cpu_seconds(server.process.pid), time.monotonic()
            document = _bench(server, run.cell, data, out, session.settings.seed)
            # Threads are matched on the command lines; what each server really burns is measured here, its
            # whole process group (vLLM's engine process and API server both) over the run's wall time.
            document[table.SERVER_CORES] = ((servers.group_cpu_seconds(server.process.pid) - cpu_before)
                                            / max(time.monotonic() - wall_before, 1e-9))
        except HarnessError as exc:
            session.results.unavailable[run.system] = f"stopped during the benchmark: {exc}"
            say(f"{run.system}: {exc}")
            continue
        session.results.add(run.system, run.cell.key, document)
        say(f"run {number}/{len(runs)}: rep {run.repetition + 1} {run.cell.key} {run.system}: "
            f"{document['output_throughput']:.0f} output tok/s, {document['failed']} failed")
    if waits:
        session.notes.append(f"before each run the servers settled to their idle CPU: {len(waits)} waits, "
                             f"median {statistics.median(waits):.1f} s, longest {max(waits):.1f} s")
    # Other work on the machine shows here; the figures are only as quiet as the machine was.
    session.notes.append(f"load average (1 min) on {os.cpu_count()} cores: {load_before:.1f} before the "
                         f"warm-up, {os.getloadavg()[0]:.1f} after the last run")


def _bench(server: servers.Server, cell: plan.Cell, data: Path, out: Path, seed: int) -> dict:
    argv = plan.bench_argv(FLARE, server.url, data, cell, out, seed)
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        why = install.error_line(done.stderr) if server.alive() else f"the server exited: {server.failure()}"
        raise HarnessError(f"flare bench {cell.key} exited {done.returncode}: {why}")
    return json.loads(out.read_text())


def _report(session: Session, args: argparse.Namespace, cells: list[plan.Cell], repetitions: int) -> None:
    labels = [(n, _spec(session, n, 0).label) for n in session.names]
    reference = next((n for n in session.names if n.startswith("flare")), session.names[0])
    text = "\n".join([
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; model {session.model.name}; {repetitions} interleaved repetition(s); medians; "
        f"ratios are system / {dict(labels)[reference]}; prompts {session.settings.input_len} tokens, "
        f"{session.settings.output_len} greedy output tokens; cells: "
        + ", ".join(f"{c.key} ({c.num_prompts} prompts)" for c in cells) + "; * = a length or failure problem (below)",
        "", table.render(session.results, labels, [c.key for c in cells], reference), "",
        "Cores the server used during each cell (its process group's CPU seconds over the cell's wall time, "
        "the client excluded; medians):", "", table.render_cores(session.results, labels, [c.key for c in cells]), "",
        *(f"- {n}" for n in session.notes)])
    (session.out / "table.md").write_text(text + "\n")
    print(text)
    say(f"written to {session.out / 'table.md'}")
