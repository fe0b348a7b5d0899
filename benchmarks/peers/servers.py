"""One server process: start it in its own process group, wait until it answers, check it, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.peers.install import error_line, say
from benchmarks.peers.systems import HarnessError, ServerSpec, Settings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(slots=True)
class Server:
    spec: ServerSpec
    url: str
    process: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def failure(self) -> str:
        return f"{error_line(self.log.read_text(errors='replace'))} (log {self.log})"


def start(spec: ServerSpec, port: int, log: Path) -> Server:
    """Start and wait for ``/health`` and ``/v1/models``; a server that exits or never answers raises."""
    say(f"{spec.name}: starting ({' '.join(spec.argv[:3])} ...; log {log})")
    sink = log.open("w")
    sink.write("$ " + " ".join(f"{k}={v}" for k, v in spec.env.items()) + " " + " ".join(spec.argv) + "\n")
    sink.flush()
    try:
        process = subprocess.Popen(spec.argv, stdout=sink, stderr=subprocess.STDOUT, env=os.environ | spec.env,
                                   start_new_session=True)
    except OSError as exc:
        raise HarnessError(f"{spec.name}: cannot start {spec.argv[0]}: {exc.strerror}") from None
    server = Server(spec, f"http://127.0.0.1:{port}", process, log)
    _wait_ready(server)
    return server


def _wait_ready(server: Server) -> None:
    started = time.monotonic()
    next_note = started + 30.0
    while time.monotonic() - started < server.spec.start_timeout_s:
        if not server.alive():
            raise HarnessError(f"{server.spec.name}: exited with status {server.process.returncode} "
                               f"while starting: {server.failure()}")
        if _answers(server.url):
            say(f"{server.spec.name}: ready on {server.url} after {time.monotonic() - started:.0f} s")
            return
        if time.monotonic() > next_note:
            say(f"{server.spec.name}: still starting ({time.monotonic() - started:.0f} s)")
            next_note += 30.0
        time.sleep(0.5)
    stop(server)
    raise HarnessError(f"{server.spec.name}: not ready after {server.spec.start_timeout_s:.0f} s: {server.failure()}")


def _answers(url: str) -> bool:
    try:
        return all(httpx.get(url + path, timeout=2.0).status_code == 200 for path in ("/health", "/v1/models"))
    except httpx.HTTPError:
        return False


def stop(server: Server) -> None:
    """SIGTERM to the server's own process group (vLLM has an engine child), SIGKILL after 30 s."""
    if not server.alive():
        return
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=30.0)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int


def complete(server: Server, prompt: str, settings: Settings) -> Completion:
    """One greedy, non-streamed completion of ``settings.output_len`` tokens."""
    model = httpx.get(server.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]  # as flare bench does
    body = {"model": model, "prompt": prompt, "max_tokens": settings.output_len, "temperature": 0.0,
            "seed": settings.seed} | server.spec.extra_body
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=300.0)
    if response.status_code != 200:
        raise HarnessError(f"{server.spec.name}: check request got HTTP {response.status_code}: {response.text[:200]}")
    data = response.json()
    usage = data.get("usage") or {}
    return Completion(data["choices"][0]["text"], usage.get("prompt_tokens", -1), usage.get("completion_tokens", -1))


def check(server: Server, prompts: list[str], settings: Settings) -> list[Completion]:
    """Every check prompt must be read as ``input_len`` tokens and answered with ``output_len``."""
    done = [complete(server, prompt, settings) for prompt in prompts]
    for number, c in enumerate(done, 1):
        if (c.prompt_tokens, c.completion_tokens) != (settings.input_len, settings.output_len):
            raise HarnessError(f"{server.spec.name}: check prompt {number}: {c.prompt_tokens} prompt and "
                               f"{c.completion_tokens} output tokens, expected {settings.input_len} and "
                               f"{settings.output_len} (an early stop, or a different tokenisation)")
    return done


def group_cpu_seconds(pgid: int) -> float:
    """User plus system CPU time of every live process in the group (for the idle check)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ..., utime (12), stime (13)
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def wait_quiet(cpu_seconds, idle_cores: float, *, window_s: float = 0.5, limit_s: float = 15.0,
               margin_cores: float = 0.1, sleep=time.sleep) -> float:
    """Wait until the servers together burn no more than they did idle (plus ``margin_cores``), measured
    over ``window_s``, or until ``limit_s``; returns the seconds waited (at least one window).

    A server keeps working after its last response: vLLM's engine kept part of a core busy, and the
    system run next on two cores read 10-15% slower. ``cpu_seconds()`` is the servers' CPU time so far.
    """
    waited = 0.0
    while True:
        before = cpu_seconds()
        sleep(window_s)
        waited += window_s
        if (cpu_seconds() - before) / window_s <= idle_cores + margin_cores or waited >= limit_s:
            return waited
