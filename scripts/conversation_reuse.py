"""Figures for conversation reuse (issue 21) on the simulator: a multi-turn workload with and without restores.

    PYTHONPATH=$PWD python scripts/conversation_reuse.py [catalog.yaml trace.yaml]

Runs the trace twice with the production scheduler (``reuse: true`` as written, then with
``reuse: false``: no checkpoint is captured or restored) and prints, per turn number, the prompt
tokens prefilled and the mean time to first token, then the share of device time spent in
state programs (restore and snapshot). Defaults: examples/simulation/conversations/.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from flare_contract.graphs import GraphKind
from helios.sim.files import load_catalog, load_trace
from helios.sim.simulator import simulate

HERE = Path(__file__).resolve().parent.parent / "examples" / "simulation" / "conversations"


def _turn(request_id: str) -> int:
    return int(request_id.rsplit("t", 1)[1]) if "t" in request_id else 1


def figures(result) -> dict:
    turns: dict[int, list] = {}
    for outcome in result.requests:
        turns.setdefault(_turn(outcome.id), []).append(outcome)
    busy = sum(p.actual_ns for p in result.plans)
    state = sum(p.actual_ns for p in result.plans if p.graph.kind in (GraphKind.RESTORE, GraphKind.SNAPSHOT))
    rows = {}
    for turn, outcomes in sorted(turns.items()):
        ttft = [o.first_output_ms() for o in outcomes if o.first_output_ms() is not None]
        rows[turn] = (sum(o.prompt_tokens - o.cached_tokens for o in outcomes), sum(o.prompt_tokens for o in outcomes),
                      sum(ttft) / len(ttft) if ttft else float("nan"))
    return {"turns": rows, "state_share": state / busy if busy else 0.0, "end_ms": result.end_ns / 1e6,
            "stalled": result.stalled}


def main(argv: list[str]) -> int:
    catalog_path, trace_path = (argv + [None, None])[:2] if argv else (HERE / "catalog.yaml", HERE / "trace.yaml")
    catalog, trace = load_catalog(catalog_path), load_trace(trace_path)
    runs = {"reuse": figures(simulate(catalog, replace(trace, reuse=True))),
            "no reuse": figures(simulate(catalog, replace(trace, reuse=False)))}
    print(f"{'turn':>4} | {'prefilled (reuse)':>17} {'prefilled (none)':>16} | {'TTFT ms (reuse)':>15} "
          f"{'TTFT ms (none)':>14} | prompt tokens")
    for turn in runs["reuse"]["turns"]:
        on, off = runs["reuse"]["turns"][turn], runs["no reuse"]["turns"][turn]
        print(f"{turn:>4} | {on[0]:>17} {off[0]:>16} | {on[2]:>15.1f} {off[2]:>14.1f} | {on[1]}")
    for name, run in runs.items():
        print(f"{name}: state programs {100 * run['state_share']:.2f}% of device time, "
              f"workload ends at {run['end_ms']:.1f} ms{' (STALLED)' if run['stalled'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
