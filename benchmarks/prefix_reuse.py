"""Prefix reuse on a live `flare run` (issue 21's figures): the same workloads with and without reuse.

    .venv/bin/python benchmarks/prefix_reuse.py [CATALOG] [--threads 1] [--rounds 2]

Starts `flare run` (the bundled model when no catalog is named) once with
`--prefix-reuse` and once with `--no-prefix-reuse` per round, alternating, and
runs on each:

1. a 4-turn chat: a system prompt, then each turn adds a user message and the
   model's answer, so the prompt grows to about 2,000 tokens; TTFT per turn;
2. 16 concurrent chats sharing a 1,500-token system prompt, sent after one
   chat with that prompt alone: prompt tokens computed (prompt tokens less
   `usage.prompt_tokens_details.cached_tokens`), output tokens/s, wall time.
   A shared prefix is reused where it ends at a message end (K1 anchors);
   a plain completion's only anchor is its whole prompt.

It prints, per round and reuse setting, those figures, the checkpoint memory
held and the share of device time in restore/snapshot programs (both from
`/metrics`), and the medians of the TTFT ratios at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

READY = re.compile(r"ready on (http://[^\s:]+:(\d+))")
WORDS = ("river bridge lantern copper signal meadow harbour engine market winter orchard ladder "
         "thunder compass garden silver canyon falcon marble candle forest mirror anchor window").split()


def text_of(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def start(catalog: str | None, threads: int, reuse: bool, log: Path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "helios.cli", "run", *([catalog, "--trust-catalog"] if catalog else []),
               "--port", "0", "--threads", str(threads), "--speculation", "off", "--disable-log-requests",
               "--log-stats-interval", "0", "--prefix-reuse" if reuse else "--no-prefix-reuse"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"flare run exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        found = READY.search(log.read_text())
        if found and int(found.group(2)) > 0:
            try:
                if httpx.get(f"{found.group(1)}/health", timeout=1.0).status_code == 200:
                    return process, found.group(1)
            except httpx.TransportError:
                pass
        time.sleep(0.5)
    raise SystemExit("flare run did not get ready within an hour")


def streamed(client: httpx.Client, path: str, body: dict) -> tuple[float, int, int, int]:
    """(TTFT s, prompt tokens, cached tokens, output tokens) of one streamed request."""
    began, first, usage = time.perf_counter(), None, {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    with client.stream("POST", path, json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            # the first chunk carrying text: a chat stream opens with a role chunk, sent before any token
            if first is None and any((c.get("delta") or {}).get("content") or c.get("text")
                                     for c in chunk.get("choices") or ()):
                first = time.perf_counter() - began
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return first or 0.0, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), usage.get("completion_tokens", 0)


def chat(base: str, rng: random.Random) -> list[tuple[float, int, int]]:
    """Four turns; each adds ~110 words of user text and the model's answer (32 tokens)."""
    messages = [{"role": "system", "content": "You are a careful assistant. " + text_of(220, rng)}]
    turns = []
    with httpx.Client(base_url=base, timeout=600.0) as client:
        for _ in range(4):
            messages.append({"role": "user", "content": text_of(110, rng)})
            body = {"model": "flare-tiny", "messages": messages, "max_tokens": 32}
            ttft, prompt, cached, _ = streamed(client, "/v1/chat/completions", body)
            answer = client.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            turns.append((ttft, prompt, cached))
    return turns


def shared_prefix(base: str, rng: random.Random) -> dict:
    """16 chats sharing a ~1,500-token system prompt (a message end, so a K1 anchor), each with its own
    question. One unrelated chat first lets the server measure its programs (unknown costs arm no extra
    capture, K2), then one chat with the shared prompt alone, then the 16 at once."""
    system = {"role": "system", "content": text_of(700, rng)}
    ask = lambda words: {"model": "flare-tiny", "max_tokens": 32,
                         "messages": [system, {"role": "user", "content": text_of(words, rng)}]}
    with httpx.Client(base_url=base, timeout=600.0) as client:
        streamed(client, "/v1/chat/completions", {"model": "flare-tiny", "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": text_of(40, rng)}]})
        streamed(client, "/v1/chat/completions", ask(12))  # the shared prompt is prefilled once, alone
        bodies = [ask(12) for _ in range(16)]
        began = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda b: streamed(client, "/v1/chat/completions", b), bodies))
        wall = time.perf_counter() - began
    computed = sum(p - c for _, p, c, _ in results)
    output = sum(o for *_, o in results)
    return {"prompt_tokens": sum(p for _, p, _, _ in results), "computed": computed,
            "tokens_per_s": output / wall, "wall_s": wall, "ttft_p50": statistics.median(r[0] for r in results)}


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def state_share(text: str) -> float:
    kinds = {kind: metric(text, "flare_scheduler_execution_nanoseconds_total", graph_kind=kind)
             for kind in ("prefill", "decode", "mixed", "speculative", "scored_prefill", "restore", "snapshot")}
    total = sum(kinds.values())
    return (kinds["restore"] + kinds["snapshot"]) / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("catalog", nargs="?", help="catalog folder (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ratios = {turn: [] for turn in range(4)}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            by_setting = {}
            for reuse in ((True, False) if round_ % 2 == 0 else (False, True)):
                process, base = start(args.catalog, args.threads, reuse, Path(scratch) / "server.log")
                try:
                    turns = chat(base, random.Random(round_))
                    shared = shared_prefix(base, random.Random(100 + round_))
                    text = httpx.get(f"{base}/metrics").text
                finally:
                    process.terminate()
                    process.wait(60)
                by_setting[reuse] = turns
                name = "reuse" if reuse else "none"
                print(f"round {round_} {name}: chat TTFT ms per turn "
                      + ", ".join(f"{t * 1e3:.0f} (prompt {p}, cached {c})" for t, p, c in turns))
                print(f"round {round_} {name}: shared prefix: {shared['computed']}/{shared['prompt_tokens']} prompt "
                      f"tokens computed, {shared['tokens_per_s']:.1f} output tok/s, {shared['wall_s']:.2f} s, "
                      f"TTFT p50 {shared['ttft_p50'] * 1e3:.0f} ms; checkpoint bytes held "
                      f"{metric(text, 'flare_checkpoint_bytes') / 2**20:.0f} MiB; state programs "
                      f"{state_share(text) * 100:.2f}% of device time", flush=True)
            for turn in range(4):
                ratios[turn].append(by_setting[False][turn][0] / max(by_setting[True][turn][0], 1e-9))
    print("TTFT without / with reuse, median over rounds: "
          + ", ".join(f"turn {t + 1} {statistics.median(r):.2f}x" for t, r in ratios.items()))


if __name__ == "__main__":
    main()
