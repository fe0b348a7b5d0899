"""Rewrite tests/helios/data/plan_regression.json from the current scheduler.

    .venv/bin/python scripts/record_plan_regression.py [--out PATH]

Run it only when a change is *meant* to alter scheduling decisions (and say so
in the commit): the file is a regression guard for refactors and speed work,
not a statement of correct behaviour; the spec tests are that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helios"))

from plan_regression_cases import record_all  # noqa: E402

DEFAULT_OUT = ROOT / "tests" / "helios" / "data" / "plan_regression.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    recorded = record_all()
    args.out.write_text(json.dumps(recorded, separators=(",", ":"), sort_keys=True) + "\n")
    plans = sum(len(case["plans"]) for case in recorded.values())
    print(f"wrote {args.out}: {len(recorded)} cases, {plans} plans", file=sys.stderr)


if __name__ == "__main__":
    main()
