"""What funded exploration costs and how fast it follows acceptance (issue 4, closing figures).

    .venv/bin/python benchmarks/exploration_figures.py [--seconds 60] [--seed 1] [--ttl-ms 30000]

Runs the real scheduler in the simulator on the example catalog
(examples/simulation/catalog.yaml: 78 shapes, decode, speculative widths 2..8,
prefill and mixed) over a mixed workload of ``--seconds`` simulated seconds:
chats arriving in waves with idle gaps between them, a few long documents, and
acceptance that changes mid-stream. A third of the requests start with drafts
never accepted and switch, after 100 to 300 tokens, to drafts mostly accepted
("risers"); others fall the other way or stay put.

Printed figures:
- device time per selection reason, and the fractions spent on timing refresh
  and on acceptance learning, beside their funding shares (1/499 and 1/99 of
  ordinary time, spec D6/D8);
- for every riser that was running narrow (its last round before the shift
  verified at most one draft for it) and ran on after the shift: how many of
  its tokens were published between the shift and the first ordinary round
  that gave it width >= 4 (its "follow" distance), and how many of those came
  before a probe (when one was needed). In a rectangular batch every lane gets
  the program's width, so risers batched with speculating neighbours were
  never narrow and are left out;
- the same distance for a lone riser (no neighbours, no idle), shifting after
  300 tokens, for each seed 0..9: the case the spec's probe exists for.

No assertion: this prints. The tests in tests/helios/test_simulator_trace.py
check the bounds and the width following.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helios.sim.files import load_catalog, parse_trace  # noqa: E402
from helios.sim.simulator import SimulationOptions, SimulationResult, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NONE, HIGH = [0.05, 0.01], [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65]


def workload(seconds: float, seed: int, ttl_ms: float) -> dict:
    """Waves of chats every ~2 s with idle time between, plus a document every ~10 s."""
    rng = random.Random(seed)
    requests, t, n = [], 0.0, 0
    while t < seconds * 1000:
        for _ in range(rng.randint(2, 6)):
            requests.append(_chat(rng, n, t + rng.uniform(0, 200)))
            n += 1
        if rng.random() < 0.2:
            requests.append({"id": f"doc{n}", "arrival_ms": t, "prompt_tokens": rng.randint(2000, 6000),
                             "max_tokens": 200, "acceptance": [0.6, 0.4, 0.2]})
            n += 1
        t += rng.uniform(1500, 2500)
    return {"seed": seed, "policy": {"estimate_ttl_ns": int(ttl_ms * 1e6)}, "requests": requests}


def _chat(rng: random.Random, n: int, arrival_ms: float) -> dict:
    kind = n % 3
    request = {"id": f"{('riser', 'faller', 'steady')[kind]}{n}", "arrival_ms": arrival_ms,
               "prompt_tokens": rng.randint(64, 700), "max_tokens": rng.randint(400, 900)}
    if kind == 0:
        request["acceptance"] = NONE
        request["acceptance_schedule"] = [{"after_tokens": rng.randint(100, 300), "acceptance": HIGH}]
    elif kind == 1:
        request["acceptance"] = HIGH
        request["acceptance_schedule"] = [{"after_tokens": rng.randint(100, 300), "acceptance": NONE}]
    else:
        request["acceptance"] = [0.7, 0.5, 0.3]
    return request


def follow_distances(result: SimulationResult, trace) -> list[tuple[str, int, int | None]]:
    """Per narrow riser: tokens from its shift to its first ordinary round of width >= 4, and to the probe before it."""
    out = []
    for spec in trace.requests:
        if not spec.id.startswith("riser"):
            continue
        outcome = result.request(spec.id)
        shift_ns = _time_reaching(outcome, spec.acceptance_schedule[0].after_tokens)
        if shift_ns is None or _width_before(result, spec.id, shift_ns) > 2:
            continue
        probe_ns, wide_ns = None, None
        for plan in result.plans:
            if plan.start_ns < shift_ns or spec.id not in plan.cohort:
                continue
            width = plan.lane_widths[plan.cohort.index(spec.id)]
            if plan.reason == "acceptance_learning" and probe_ns is None:
                probe_ns = plan.start_ns
            if plan.reason == "ordinary" and width >= 4:
                wide_ns = plan.start_ns
                break
        if wide_ns is None:
            continue
        base = outcome.tokens_by(shift_ns)
        to_probe = None if probe_ns is None else outcome.tokens_by(probe_ns) - base
        out.append((spec.id, outcome.tokens_by(wide_ns) - base, to_probe))
    return out


def _width_before(result: SimulationResult, rid: str, time_ns: int) -> int:
    widths = [p.lane_widths[p.cohort.index(rid)] for p in result.plans if p.end_ns <= time_ns and rid in p.cohort]
    return widths[-1] if widths else 0


def lone_riser(catalog, seed: int) -> int | None:
    """Tokens a lone riser publishes between its acceptance rise (after 300 tokens) and its first width >= 4 round."""
    trace = parse_trace({"seed": seed, "requests": [{
        "id": "riser0", "prompt_tokens": 128, "max_tokens": 1500, "acceptance": NONE,
        "acceptance_schedule": [{"after_tokens": 300, "acceptance": HIGH}]}]})
    follows = follow_distances(simulate(catalog, trace), trace)
    return follows[0][1] if follows else None


def _time_reaching(outcome, tokens: int) -> int | None:
    total = 0
    for burst in outcome.bursts:
        total += burst.tokens
        if total >= tokens:
            return burst.time_ns
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ttl-ms", type=float, default=30_000.0, help="estimate freshness interval (policy default 30 s)")
    args = parser.parse_args()
    catalog = load_catalog(ROOT / "examples/simulation/catalog.yaml")
    trace = parse_trace(workload(args.seconds, args.seed, args.ttl_ms))
    result = simulate(catalog, trace, SimulationOptions(until_ns=int(args.seconds * 1e9)))
    by_reason = result.device_ms_by_reason()
    busy = sum(by_reason.values())
    ordinary = by_reason.get("ordinary", 0.0)
    print(f"workload: {len(trace.requests)} requests over {args.seconds:g} s simulated, seed {args.seed}, "
          f"estimate ttl {args.ttl_ms:g} ms; device busy {busy:.0f} ms ({busy / (args.seconds * 10):.1f}% of the run)")
    for reason in ("ordinary", "discovery", "timing_refresh", "acceptance_learning"):
        ms = by_reason.get(reason, 0.0)
        plans = sum(p.reason == reason for p in result.plans)
        print(f"  {reason:20s} {plans:6d} plans {ms:10.1f} ms  {100 * ms / busy if busy else 0:6.3f}% of device time")
    for reason, share in (("timing_refresh", 1 / 499), ("acceptance_learning", 1 / 99)):
        ms = by_reason.get(reason, 0.0)
        print(f"  {reason}: {ms / ordinary if ordinary else 0:.5f} of ordinary time (funding share {share:.5f})")
    follows = follow_distances(result, trace)
    if follows:
        tokens = [t for _, t, _ in follows]
        print(f"narrow risers followed: {len(follows)}; tokens from the acceptance rise to the first ordinary "
              f"round of width >= 4: median {statistics.median(tokens):.0f}, max {max(tokens)}, min {min(tokens)}")
        probed = [t for _, _, t in follows if t is not None]
        print(f"  {len(probed)} of them were probed first; tokens from the rise to that probe: "
              f"median {statistics.median(probed) if probed else 0:.0f}")
    else:
        print("no narrow riser was followed within the run")
    lone = [lone_riser(catalog, seed) for seed in range(10)]
    followed = [t for t in lone if t is not None]
    print(f"lone riser, seeds 0..9: followed in {len(followed)}/10; tokens from the rise to width >= 4: "
          f"{sorted(followed)}")


if __name__ == "__main__":
    main()
