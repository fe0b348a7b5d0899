"""Running install steps: each once (a finished step is skipped), its output to a log, progress on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers.systems import HarnessError, Step

HEARTBEAT_S = 30.0
ERROR_WORDS = ("error", "failed", "not found", "no matching distribution", "could not", "cannot")


def say(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def error_line(log_text: str) -> str:
    """The line of a log that names the problem: the last one with an error word, else the last non-empty one."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(word in line.lower() for word in ERROR_WORDS):
            return line
    return lines[-1] if lines else "no output"


def run_steps(system: str, steps: list[Step], logs: Path) -> None:
    """Run each step not yet done; the first failure raises with the step, its error line and its log."""
    logs.mkdir(parents=True, exist_ok=True)
    for number, step in enumerate(steps, 1):
        if step.done.exists():
            say(f"{system} {number}/{len(steps)}: {step.name}: already done")
            continue
        log = logs / f"{system}-{number}.log"
        say(f"{system} {number}/{len(steps)}: {step.name} (log: {log})")
        started = time.monotonic()
        code = _run_logged(step, log)
        if code != 0:
            raise HarnessError(f"{step.name}: {error_line(log.read_text(errors='replace'))} (exit {code}; log {log})")
        if not step.done.exists():  # a step whose output is not a file of its own gets a marker
            step.done.parent.mkdir(parents=True, exist_ok=True)
            step.done.touch()
        say(f"{system} {number}/{len(steps)}: done in {time.monotonic() - started:.0f} s")


def _run_logged(step: Step, log: Path) -> int:
    """Run with output to ``log``; every HEARTBEAT_S print the elapsed time and the log's last line."""
    started = time.monotonic()
    with log.open("w") as sink:
        sink.write("$ " + " ".join(step.argv) + "\n")
        sink.flush()
        try:
            process = subprocess.Popen(step.argv, stdout=sink, stderr=subprocess.STDOUT, cwd=step.cwd,
                                       env=os.environ | {"PIP_PROGRESS_BAR": "off"})
        except OSError as exc:
            sink.write(f"error: cannot start {step.argv[0]}: {exc.strerror}\n")
            return 127
        while True:
            try:
                return process.wait(timeout=HEARTBEAT_S)
            except subprocess.TimeoutExpired:
                last = _last_line(log)
                say(f"  ... {time.monotonic() - started:.0f} s: {last[:100]}")


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
