"""Issue 20, item 4: stalls and first outputs on a live ``flare run``, per scheduler policy.

    .venv/bin/python benchmarks/live_schedule.py [--port 8731] [--threads 1] [--repeats 1]
        [--policy before=prefill_defers_decode=0] [--policy after=] [--catalog FOLDER [--trust-catalog]]

For each policy (a label and a comma-separated list of ``--scheduler-choice`` items, empty for the
defaults) it starts ``flare run`` on the bundled model, or on the catalog folder ``--catalog`` names (a
flare-tiny capture with ``--mixed-prefill``, say: the bundled catalog has no mixed programs, so the
deferred round never applies there; a compiled catalog also needs ``--trust-catalog``, which is passed on
to ``flare run``) (``--threads 1``, loopback), waits for
``/health``, warms the server up (one 3,000-token prompt and six short requests, unmeasured), and
runs two scenarios over streamed ``/v1/completions``:

- ``long-prompt``: four streams (32-token prompts, 384 output tokens) start; once each has its first
  chunk, a 3,000-token prompt (16 output tokens) arrives. Printed: the long prompt's TTFT and the
  largest gap between two chunks of any stream while the long prompt is in flight.
- ``burst``: two long generations (32-token prompts, 512 output tokens) start; once both stream,
  16 short chats (24-token prompts, 24 output tokens) arrive at once. Printed: TTFT p50 and max of
  the 16, and the largest inter-chunk gap of the two long generations while any chat is in flight.

Prompts are token id lists (the API accepts them), so their lengths are exact; ``ignore_eos`` keeps
every generation to its length. Policies run one after another with a fresh server each; with
``--repeats N`` the order alternates (A B, B A, ...) so that load on a shared machine hits both
alike. Figures are wall-clock milliseconds seen by the client. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB_SPAN = (100, 4000)  # token ids used for prompts: inside flare-tiny's 4096-id vocabulary


@dataclass(slots=True)
class Stream:
    """One streamed completion: when it was sent and when each chunk arrived (seconds, monotonic)."""

    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def ttft_ms(self) -> float:
        return (self.chunks[0] - self.sent) * 1e3 if self.chunks else float("nan")

    def largest_gap_ms(self, start: float, end: float) -> float:
        """Largest gap between consecutive chunks that overlaps [start, end]."""
        gaps = [b - a for a, b in zip(self.chunks, self.chunks[1:]) if b >= start and a <= end]
        return max(gaps, default=0.0) * 1e3


def prompt_ids(length: int, offset: int) -> list[int]:
    low, high = VOCAB_SPAN
    return [low + (offset * 7919 + i * 31) % (high - low) for i in range(length)]


def stream_completion(port: int, model: str, prompt: list[int], tokens: int, out: Stream) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                       "ignore_eos": True, "stream": True, "temperature": 0})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        out.sent = time.monotonic()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            out.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            if choice.get("text"):
                out.chunks.append(time.monotonic())
                out.started.set()
    except OSError as exc:
        out.error = str(exc)
    finally:
        connection.close()
        out.started.set()
        out.done.set()


def launch(port: int, model: str, prompt: list[int], tokens: int) -> Stream:
    stream = Stream()
    threading.Thread(target=stream_completion, args=(port, model, prompt, tokens, stream), daemon=True).start()
    return stream


def long_prompt(port: int, model: str) -> dict[str, float]:
    streams = [launch(port, model, prompt_ids(32, i), 384) for i in range(4)]
    for s in streams:
        s.started.wait(300)
    long = launch(port, model, prompt_ids(3000, 99), 16)
    long.done.wait(600)
    end = long.chunks[-1] if long.chunks else time.monotonic()
    for s in streams:
        s.done.wait(600)
    _check([*streams, long])
    gap = max(s.largest_gap_ms(long.sent, end) for s in streams)
    return {"long prompt TTFT ms": long.ttft_ms(), "largest stream gap ms": gap}


def burst(port: int, model: str) -> dict[str, float]:
    longs = [launch(port, model, prompt_ids(32, 50 + i), 512) for i in range(2)]
    for s in longs:
        s.started.wait(300)
    chats = [launch(port, model, prompt_ids(24, 200 + i), 24) for i in range(16)]
    for s in chats:
        s.done.wait(600)
    start, end = min(s.sent for s in chats), max((s.chunks[-1] for s in chats if s.chunks), default=time.monotonic())
    for s in longs:
        s.done.wait(600)
    _check([*longs, *chats])
    ttfts = [s.ttft_ms() for s in chats]
    return {"chat TTFT p50 ms": statistics.median(ttfts), "chat TTFT max ms": max(ttfts),
            "largest long-generation gap ms": max(s.largest_gap_ms(start, end) for s in longs)}


def warm_up(port: int, model: str) -> None:
    """Unmeasured: every prompt bucket and a few batch sizes run once, so the scheduler's first
    measurements (U8: unknown durations win) do not land in the figures."""
    streams = [launch(port, model, prompt_ids(3000, 7), 4)] + [launch(port, model, prompt_ids(24, i), 8) for i in range(6)]
    for s in streams:
        s.done.wait(600)
    _check(streams)


def _check(streams: list[Stream]) -> None:
    failed = [s.error for s in streams if s.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")


def serve(port: int, threads: int, choices: list[str], catalog: str | None = None,
          trust: bool = False) -> subprocess.Popen:
    flags = [flag for item in choices for flag in ("--scheduler-choice", item)]
    if trust:
        flags.append("--trust-catalog")
    command = [sys.executable, "-m", "helios.cli", "run", *([catalog] if catalog else []),
               "--port", str(port), "--threads", str(threads),
               "--disable-log-requests", "--log-stats-interval", "0", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tempfile.TemporaryFile()  # the server's log, read back only if it fails (a pipe could fill and block it)
    server = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 1800  # a first start may capture the bundled catalog
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"flare run exited {server.returncode}: {log.read().decode()[-2000:]}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            pass
        time.sleep(1.0)
    server.kill()
    raise RuntimeError("flare run did not become healthy")


def model_name(port: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/v1/models")
    return json.loads(connection.getresponse().read())["data"][0]["id"]


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def parse_policy(text: str) -> tuple[str, list[str]]:
    label, _, items = text.partition("=")
    return label, [item for item in items.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--policy", action="append", default=None,
                        help="LABEL=choice,choice (--scheduler-choice items); repeatable")
    parser.add_argument("--catalog", help="catalog folder for flare run (default: the bundled model)")
    parser.add_argument("--trust-catalog", action="store_true",
                        help="pass --trust-catalog to flare run: a compiled catalog (AOTInductor packages) "
                             "loads only with it (docs/catalog-format.md, \"Trust\")")
    args = parser.parse_args(argv)
    if args.trust_catalog and not args.catalog:
        print("error: --trust-catalog needs --catalog (the bundled model is trusted already)", file=sys.stderr)
        return 2
    policies = [parse_policy(p) for p in (args.policy or ["before=prefill_defers_decode=0", "after="])]
    for repeat in range(args.repeats):
        order = policies if repeat % 2 == 0 else policies[::-1]
        for label, choices in order:
            server = serve(args.port, args.threads, choices, args.catalog, args.trust_catalog)
            try:
                model = model_name(args.port)
                warm_up(args.port, model)
                for name, scenario in (("long-prompt", long_prompt), ("burst", burst)):
                    figures = scenario(args.port, model)
                    cells = ", ".join(f"{key} {value:.1f}" for key, value in figures.items())
                    print(f"[{repeat}] {label:8s} {name:12s} {cells}", flush=True)
            finally:
                stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
