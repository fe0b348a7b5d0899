"""A held-out prompt set for `flare bench --dataset FILE.jsonl` (issue 7's live acceptance figure).

    .venv/bin/python -m scripts.bundled_model.heldout_prompts --out build/heldout.jsonl [--count 64]

Each line is one completion request: the text of a held-out standard-library
file (the training run's own split, so the bundled models never saw it) up
to and including one top-level function header, cut at the header's colon
(the BPE joins a newline with the next indentation, so a prompt ending in a
bare newline reads as the end of a block). At most ``--context-chars`` of
the text before the header are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.bundled_model import evaluate as ev
from scripts.bundled_model.corpus import CorpusError, default_root, load_corpus


def prompts(root: Path, count: int, context_chars: int, heldout_percent: float, seed: int) -> list[dict]:
    corpus = load_corpus(root, heldout_percent)
    headers = ev.function_headers(corpus.heldout, count, seed)
    return [{"prompt": h.context[-context_chars:] + h.line} for h in headers]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--count", type=int, default=64, help="prompts (at most the held-out headers available)")
    p.add_argument("--context-chars", type=int, default=1200, help="text kept before each header")
    p.add_argument("--corpus", type=Path, default=default_root())
    p.add_argument("--heldout-percent", type=float, default=5.0, help="must match the training run's split")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.count < 1 or args.context_chars < 0:
        p.error("--count must be >= 1 and --context-chars >= 0")
    try:
        lines = prompts(args.corpus, args.count, args.context_chars, args.heldout_percent, args.seed)
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} held-out prompts -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
