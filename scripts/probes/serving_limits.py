"""Probes of ``flare run`` under overload and hostile clients (issue 17, parts 4 and 5).

Each probe starts its own ``flare run CATALOG`` on a free loopback port, runs
for a bounded time, prints one JSON line of figures and stops the server:

- ``stall``: two running streams, then one large prompt submitted; prints the
  longest gap between chunks of a running stream before and while the large
  prompt is admitted, the large request's status and how long ``/health``
  took meanwhile.
- ``overload``: N requests sent at once; counts statuses, 5xx, hangs (no
  answer within the deadline), the longest wait and the server's RSS growth.
- ``slow-client``: connections that send nothing, half a request head, or a
  body shorter than their Content-Length; prints how each one ended and when.
- ``tokenizer-gil`` (no server): the longest time the main thread is kept
  from running while a worker thread encodes the large prompt, with the
  ``tokenizers`` library's plain ``encode`` and with ``CheckpointTokenizer.encode``.

Usage: ``python scripts/probes/serving_limits.py stall --catalog DIR [--flare-args "--max-waiting 64"]``.
Loopback only; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
WORDS = ("serving", "engine", "token", "the", "of", "prefill", "décodé", "日本語", "graph", "42", "\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def flare_run(catalog: Path, extra: list[str]):
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    command = [sys.executable, "-m", "helios.cli", "run", str(catalog), "--port", str(port), "--threads", "1", *extra]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, f"flare run exited: {Path(log.name).read_text()[-2000:]}"
            assert time.monotonic() < deadline, "flare run not ready after 300 s"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
        yield base, process.pid
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def model_name(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ---------------------------------------------------------------- stall


def big_prompt(size: int) -> str:
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(size // 5))
    while len(text.encode()) > size:
        text = text[: len(text) - (len(text.encode()) - size) // 3 - 1]
    return text


class Stream(threading.Thread):
    """One streamed completion, restarted whenever it ends, recording chunk arrival times."""

    def __init__(self, base: str, model: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.base, self.model, self.stop = base, model, stop
        self.gaps: list[tuple[float, float]] = []  # (arrival time, gap since the previous chunk)

    def run(self) -> None:
        body = {"model": self.model, "prompt": "The engine", "max_tokens": 3000, "temperature": 1.0, "stream": True}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                with client.stream("POST", f"{self.base}/v1/completions", json=body) as response:
                    last = None
                    for line in response.iter_lines():
                        now = time.perf_counter()
                        if line.startswith("data: "):
                            if last is not None:
                                self.gaps.append((now, now - last))
                            last = now
                        if self.stop.is_set():
                            break


def stall(base: str, pid: int, size: int) -> dict:
    model = model_name(base)
    stop = threading.Event()
    streams = [Stream(base, model, stop) for _ in range(2)]
    for stream in streams:
        stream.start()
    time.sleep(3.0)
    prompt = big_prompt(size)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}, ensure_ascii=False).encode()
    health: list[float] = []

    def poll_health() -> None:
        while not stop.is_set():
            began = time.perf_counter()
            httpx.get(f"{base}/health", timeout=60)
            health.append(time.perf_counter() - began)
            time.sleep(0.05)

    poller = threading.Thread(target=poll_health, daemon=True)
    submitted = time.perf_counter()
    poller.start()
    response = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120)
    answered = time.perf_counter()
    time.sleep(1.0)
    stop.set()
    for stream in streams:
        stream.join(60)
    poller.join(60)
    before = [gap for stream in streams for at, gap in stream.gaps if at < submitted]
    during = [gap for stream in streams for at, gap in stream.gaps if submitted <= at <= answered + 0.5]
    return {
        "body_bytes": len(body), "status": response.status_code, "error_code": _code(response),
        "answered_s": round(answered - submitted, 3),
        "longest_gap_before_ms": round(1000 * max(before, default=0), 1),
        "longest_gap_during_ms": round(1000 * max(during, default=0), 1),
        "chunks_during": len(during), "slowest_health_ms": round(1000 * max(health, default=0), 1),
    }


def _code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- overload


async def overload(base: str, pid: int, count: int, max_tokens: int, deadline_s: float) -> dict:
    model = model_name(base)
    rss_before = rss_bytes(pid)
    peak = [rss_before]
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
    async with httpx.AsyncClient(base_url=base, timeout=deadline_s, limits=limits) as client:
        async def one(i: int) -> tuple[str, float, str | None]:
            body = {"model": model, "prompt": f"request {i}: the engine", "max_tokens": max_tokens, "temperature": 0}
            began = time.perf_counter()
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                return "hang", time.perf_counter() - began, None
            except httpx.TransportError as exc:
                return f"transport:{type(exc).__name__}", time.perf_counter() - began, None
            retry = response.headers.get("retry-after")
            return str(response.status_code), time.perf_counter() - began, (_code(response), retry)

        async def watch_rss() -> None:
            while True:
                peak[0] = max(peak[0], rss_bytes(pid))
                await asyncio.sleep(0.2)

        watcher = asyncio.ensure_future(watch_rss())
        results = await asyncio.gather(*(one(i) for i in range(count)))
        watcher.cancel()
    statuses: dict[str, int] = {}
    for status, _, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    served = [wait for status, wait, _ in results if status == "200"]
    refused = [extra for status, _, extra in results if status == "503"]
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        "sent": count, "statuses": statuses, "5xx_other_than_503": sum(n for s, n in statuses.items() if s.startswith("5") and s != "503"),
        "hangs": statuses.get("hang", 0), "max_wait_s": round(max(served, default=0), 2),
        "503_codes_and_retry_after": sorted({str(x) for x in refused}),
        "rss_growth_mb": round((peak[0] - rss_before) / 2**20, 1),
        "metrics": [line for line in metrics.splitlines() if line.startswith(("flare_requests_total", "flare_requests_shed_total"))],
    }


# ---------------------------------------------------------------- slow clients


def slow_client(base: str, pid: int, wait_s: float) -> dict:
    port = int(base.rsplit(":", 1)[1])
    cases = {
        "silent connection": b"",
        "half a request head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
        "Content-Length 1000, 9 bytes sent": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                              b"Content-Length: 1000\r\n\r\n{\"model\":"),
    }
    results = {}
    threads = []

    def probe(name: str, payload: bytes) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.settimeout(wait_s)
        began = time.perf_counter()
        sock.sendall(payload)
        try:
            reply = sock.recv(4096)
            status = reply.split(b"\r\n", 1)[0].decode(errors="replace") if reply else "closed by the server"
            results[name] = {"ended": status, "after_s": round(time.perf_counter() - began, 1)}
        except TimeoutError:
            results[name] = {"ended": f"hang (still open after {wait_s} s)"}
        finally:
            sock.close()

    for name, payload in cases.items():
        threads.append(threading.Thread(target=probe, args=(name, payload)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return results


# ---------------------------------------------------------------- tokenizer and GIL


def tokenizer_gil(size: int) -> dict:
    from tokenizers import Tokenizer

    from helios.text.tokenizer import CheckpointTokenizer

    folder = REPO / "ignition/models/bundled/flare-tiny/target"
    raw, ours = Tokenizer.from_file(str(folder / "tokenizer.json")), CheckpointTokenizer.from_folder(folder)
    text = big_prompt(size)
    result = {"prompt_bytes": len(text.encode())}
    for name, encode in (("tokenizers_encode", lambda: raw.encode(text)),
                         ("CheckpointTokenizer_encode", lambda: ours.encode(text, add_special_tokens=True))):
        total, gap = _longest_main_thread_gap(encode)
        result[name] = {"encode_s": round(total, 2), "longest_main_thread_gap_ms": round(1000 * gap, 1)}
    return result


def _longest_main_thread_gap(work) -> tuple[float, float]:
    done = threading.Event()
    worker = threading.Thread(target=lambda: (work(), done.set()))
    began = last = time.perf_counter()
    longest = 0.0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    return time.perf_counter() - began, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=("stall", "overload", "slow-client", "tokenizer-gil"))
    parser.add_argument("--catalog", type=Path, help="catalog folder for flare run (every probe but tokenizer-gil)")
    parser.add_argument("--size", type=int, default=4 * 1024 * 1024 - 128 * 1024, help="stall: prompt bytes (UTF-8)")
    parser.add_argument("--count", type=int, default=500, help="overload: requests sent at once")
    parser.add_argument("--max-tokens", type=int, default=32, help="overload: max_tokens per request")
    parser.add_argument("--deadline", type=float, default=120.0, help="overload/slow-client: seconds before a request counts as hung")
    parser.add_argument("--flare-args", default="", help="more flare run flags, one quoted string")
    args = parser.parse_args()
    if args.probe == "tokenizer-gil":
        print(json.dumps(tokenizer_gil(args.size)))
        return
    if args.catalog is None:
        parser.error(f"{args.probe} needs --catalog")
    with flare_run(args.catalog, shlex.split(args.flare_args)) as (base, pid):
        if args.probe == "stall":
            result = stall(base, pid, args.size)
        elif args.probe == "overload":
            result = asyncio.run(overload(base, pid, args.count, args.max_tokens, args.deadline))
        else:
            result = slow_client(base, pid, args.deadline)
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
