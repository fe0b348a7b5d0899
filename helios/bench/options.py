"""Parsing ``flare bench``'s textual flags into a ``BenchConfig``; every error names the flag."""

from __future__ import annotations

import math
from dataclasses import dataclass

from helios.bench.client import Target
from helios.bench.datasets import DatasetSpec, LengthRange
from helios.bench.metrics import Slo
from helios.bench.runner import BenchConfig, BenchError

SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class BenchFlags:
    """The command line as typed, before parsing."""

    url: str
    model: str
    endpoint: str
    num_prompts: int
    request_rate: str
    burstiness: float
    max_concurrency: int | None
    dataset: str
    input_len: str
    output_len: str
    seed: int
    goodput: tuple[str, ...]
    api_key: str | None
    fairness_window_ms: float


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise BenchError(f"--request-rate {text!r}: expected a positive number of requests per second, or inf")
    return rate


def parse_slo(items: tuple[str, ...]) -> Slo:
    """``ttft:MS tpot:MS e2el:MS``, any subset, each at most once."""
    limits: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if name not in SLO_NAMES or name in limits or not 0 < limit < math.inf:
            raise BenchError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)} "
                             "(each once) and MS a positive number")
        limits[name] = limit
    return Slo(**{f"{name}_ms": limit for name, limit in limits.items()})


def config_from(flags: BenchFlags) -> BenchConfig:
    dataset = DatasetSpec(flags.dataset, flags.num_prompts, LengthRange.parse(flags.input_len, "--input-len"),
                          LengthRange.parse(flags.output_len, "--output-len"), flags.seed)
    return BenchConfig(
        target=Target(flags.url, flags.endpoint, flags.model, flags.api_key),
        dataset=dataset,
        request_rate=parse_rate(flags.request_rate),
        burstiness=flags.burstiness,
        max_concurrency=flags.max_concurrency,
        slo=parse_slo(flags.goodput),
        fairness_window_s=flags.fairness_window_ms / 1000.0,
    )


def settings_json(config: BenchConfig, model: str, started: str) -> dict:
    """The run's settings under vLLM's key names, for the top of the --json document."""
    slo = {name: getattr(config.slo, f"{name}_ms") for name in SLO_NAMES if getattr(config.slo, f"{name}_ms")}
    return {
        "date": started,
        "backend": "openai-chat" if config.target.endpoint == "chat" else "openai",
        "model_id": model,
        "base_url": config.target.url,
        "dataset": config.dataset.name,
        "num_prompts": config.dataset.count,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "seed": config.dataset.seed,
        "goodput_slo_ms": slo or None,
        "jain_window_ms": config.fairness_window_s * 1000.0,
    }
