"""One benchmark run: load the dataset, send on the arrival schedule, time every stream, summarize."""

from __future__ import annotations

import asyncio
import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from helios.bench.arrivals import arrival_offsets
from helios.bench.client import ENDPOINTS, RequestResult, Target, send
from helios.bench.datasets import DatasetSpec, load_requests
from helios.bench.metrics import Slo
from helios.bench.server_metrics import deltas, scrape
from helios.bench.summary import Summary, summarize

CONNECT_TIMEOUT_S = 30.0


class BenchError(ValueError):
    """A bad setting; the message names it and what would be accepted."""


class BenchFailed(RuntimeError):
    """The server could not be asked what the run needs (its model name)."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    target: Target  # model "" asks the server's /v1/models for its first model
    dataset: DatasetSpec
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo: Slo = field(default_factory=Slo)
    fairness_window_s: float = 0.1  # the simulator report's window too
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        checks = (
            (self.target.endpoint in ENDPOINTS, f"--endpoint {self.target.endpoint!r}: expected completions or chat"),
            (self.target.url.startswith(("http://", "https://")), f"--url {self.target.url!r}: expected http://HOST:PORT"),
            (self.dataset.count >= 1, f"--num-prompts {self.dataset.count}: expected at least 1"),
            (self.request_rate > 0, f"--request-rate {self.request_rate}: expected a positive number or inf"),
            (0 < self.burstiness < math.inf, f"--burstiness {self.burstiness}: expected a positive finite number"),
            (self.max_concurrency is None or self.max_concurrency >= 1,
             f"--max-concurrency {self.max_concurrency}: expected at least 1"),
            (0 < self.fairness_window_s < math.inf,
             f"--fairness-window-ms {self.fairness_window_s * 1000}: expected a positive finite window"),
        )
        for ok, message in checks:
            if not ok:
                raise BenchError(message)


@dataclass(frozen=True, slots=True)
class BenchRun:
    model: str
    started: str  # ISO date of the start, as vLLM's "date"
    results: list[RequestResult]
    summary: Summary


def run_benchmark(config: BenchConfig, on_result: Callable[[RequestResult], None] | None = None) -> BenchRun:
    """Send every request and measure; request failures are counted in the summary, never raised."""
    requests = load_requests(config.dataset)
    if config.target.endpoint == "completions" and any(r.prompt is None for r in requests):
        raise BenchError(f"--dataset {config.dataset.name}: 'messages' lines need --endpoint chat")
    return asyncio.run(_run(config, requests, on_result or (lambda result: None)))


async def _run(config: BenchConfig, requests, on_result) -> BenchRun:
    limits = httpx.Limits(max_connections=config.max_concurrency or len(requests), max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout_s, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        target = config.target
        if not target.model:
            target = Target(target.url, target.endpoint, await _first_model(client, target), target.api_key)
        before = await scrape(client, target.url, target.headers())
        started = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        results, duration = await _send_all(client, config, target, requests, on_result)
        after = await scrape(client, target.url, target.headers())
    summary = summarize(results, duration, config.slo, config.fairness_window_s, deltas(before, after))
    return BenchRun(target.model, started, results, summary)


async def _send_all(client, config: BenchConfig, target: Target, requests, on_result) -> tuple[list[RequestResult], float]:
    """Sends on the gamma schedule; a concurrency cap delays the send itself, so waiting is not latency."""
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness,
                              np.random.default_rng(config.dataset.seed))
    gate = asyncio.Semaphore(config.max_concurrency or len(requests))

    async def one(request) -> RequestResult:
        async with gate:
            result = await send(client, target, request)
        on_result(result)
        return result

    start = time.perf_counter()
    tasks = []
    for request, offset in zip(requests, offsets):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def _first_model(client: httpx.AsyncClient, target: Target) -> str:
    try:
        response = await client.get(target.url.rstrip("/") + "/v1/models", headers=target.headers())
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchFailed(f"cannot read the model name from {target.url}/v1/models ({exc}); pass --model NAME") from None
