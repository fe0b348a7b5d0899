"""Train the bundled flare-tiny pair (issue 7): BPE tokenizer, Qwen3 target, small draft, evaluation.

    .venv/bin/python scripts/train_bundled_model.py --out build/flare-tiny --summary build/flare-tiny.json

The corpus is the standard library's own .py files (default) or any folder of
Python sources; whole files are held out by a hash of their path. Writes
OUT/target and OUT/draft as Hugging Face Qwen3 folders (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json), then prints a JSON
summary of corpus, training and held-out evaluation. CPU only; a run is
reproducible from --seed given the step counts (the summary records them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `scripts` is not an installed package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from scripts.bundled_model import evaluate as ev  # noqa: E402
from scripts.bundled_model.bpe import END_OF_TEXT, END_OF_TURN, train_tokenizer  # noqa: E402
from scripts.bundled_model.corpus import Corpus, CorpusError, SourceFile, default_root, load_corpus  # noqa: E402
from scripts.bundled_model.models import (  # noqa: E402
    DRAFT_SHAPE, SAVE_DTYPES, TARGET_SHAPE, ShapeError, build_model, round_weights, save_model, shape_summary,
)
from scripts.bundled_model.train import (  # noqa: E402
    Objective, PhaseSettings, TokenStream, distillation_loss, next_token_loss, train_phase,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder to write target/ and draft/ into")
    p.add_argument("--corpus", type=Path, default=default_root(), help="folder of .py files (site-packages skipped)")
    p.add_argument("--summary", type=Path, help="also write the JSON summary to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-percent", type=float, default=5.0, help="share of files held out (by path hash)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary, special tokens included")
    p.add_argument("--context", type=int, default=512, help="training window in tokens")
    p.add_argument("--max-positions", type=int, default=4096, help="max_position_embeddings of both models")
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--target-shape", default="", help=f"overrides, e.g. layers=4,hidden=384 (default {TARGET_SHAPE})")
    p.add_argument("--draft-shape", default="", help=f"overrides, e.g. layers=2,hidden=192 (default {DRAFT_SHAPE})")
    p.add_argument("--target-minutes", type=float, default=30.0, help="target training budget")
    p.add_argument("--draft-minutes", type=float, default=9.0, help="draft training budget")
    p.add_argument("--target-steps", type=int, help="fixed target step count (overrides the budget; reproducible)")
    p.add_argument("--draft-steps", type=int, help="fixed draft step count (overrides the budget; reproducible)")
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue training a pair this script wrote (its target/ and draft/ folders): reuses its "
                        "tokenizer and starts both models from its weights (shapes must match)")
    p.add_argument("--draft-loss", choices=("next-token", "distill"), default="next-token",
                   help="next-token: the corpus' tokens; distill: KL to the trained target's distribution")
    # Off by default: measured on the 2-core build machine (no AMX), neither paid; see docs/bundled-model.md.
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False, help="bf16 autocast in training")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile the training forward")
    p.add_argument("--save-dtype", choices=tuple(SAVE_DTYPES), default="bfloat16",
                   help="stored weight dtype; bfloat16 keeps the default pair under issue 7's 30 MB "
                        "(fp32 would be ~38 MB); evaluation runs on the rounded weights")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads; use 1 on a machine shared with other jobs (2 threads spin-wait)")
    p.add_argument("--eval-windows", type=int, default=32, help="held-out windows (of --context tokens) for loss/agreement")
    p.add_argument("--long-context-windows", type=int, default=2, help="held-out windows of --max-positions tokens")
    p.add_argument("--spec-prompts", type=int, default=16)
    p.add_argument("--spec-prompt-tokens", type=int, default=128)
    p.add_argument("--spec-new-tokens", type=int, default=48)
    p.add_argument("--headers", type=int, default=20, help="held-out function headers to continue")
    p.add_argument("--header-new-tokens", type=int, default=96)
    p.add_argument("--samples", type=int, default=3, help="greedy samples kept in the summary")
    return p.parse_args(argv)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def encode(tokenizer: Tokenizer, files: tuple[SourceFile, ...]) -> torch.Tensor:
    """All files as one stream, each followed by <|endoftext|> (as documents are packed in training)."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch([f.text for f in files]):
        ids.extend(encoding.ids)
        ids.append(end)
    return torch.tensor(ids, dtype=torch.long)


def phase(args: argparse.Namespace, name: str, seed_offset: int) -> PhaseSettings:
    return PhaseSettings(
        minutes=getattr(args, f"{name}_minutes"), steps=getattr(args, f"{name}_steps"), context=args.context,
        batch_size=args.batch_size, learning_rate=getattr(args, f"{name}_lr"), warmup_steps=args.warmup_steps,
        seed=args.seed + seed_offset, bf16=args.bf16, compile=args.compile,
    )


def eval_settings(args: argparse.Namespace) -> ev.EvalSettings:
    return ev.EvalSettings(
        context=args.context, windows=args.eval_windows, long_windows=args.long_context_windows,
        spec_prompts=args.spec_prompts, spec_prompt_tokens=args.spec_prompt_tokens,
        spec_new_tokens=args.spec_new_tokens, headers=args.headers, header_context_chars=4 * args.context,
        header_new_tokens=args.header_new_tokens, samples=args.samples, seed=args.seed,
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(args.threads)
    shapes = {"target": TARGET_SHAPE.with_overrides(args.target_shape),
              "draft": DRAFT_SHAPE.with_overrides(args.draft_shape)}
    corpus = load_corpus(args.corpus, args.heldout_percent)
    log(f"corpus: {len(corpus.train)} training and {len(corpus.heldout)} held-out files")
    tokenizer = _tokenizer(args, corpus)
    train_stream, heldout = encode(tokenizer, corpus.train), encode(tokenizer, corpus.heldout)
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens; {len(train_stream)} training tokens")
    models, summary = {}, {}
    for offset, name in enumerate(("target", "draft")):  # the target first: a distilled draft learns from it
        config = shapes[name].config(tokenizer.get_vocab_size(), args.max_positions)
        models[name] = build_model(config, tokenizer, args.seed + offset)
        if args.init_from is not None:
            _load_weights(models[name], args.init_from / name)
        log(f"training {name} ({sum(p.numel() for p in models[name].parameters())} parameters)")
        report = train_phase(models[name], TokenStream(train_stream), phase(args, name, 100 * offset),
                             objective(args, name, models), log)
        round_weights(models[name], args.save_dtype)
        save_model(args.out / name, models[name], config, tokenizer, args.save_dtype)
        summary[name] = {**shape_summary(shapes[name], config), "training": _report(report)}
    summary["draft"]["loss"] = args.draft_loss
    log("evaluating")
    evaluation = evaluate(models["target"], models["draft"], tokenizer, corpus, heldout, eval_settings(args))
    corpus_summary = corpus.summary()
    return {
        "corpus": corpus_summary,
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "train_tokens": len(train_stream),
                      "heldout_tokens": len(heldout),
                      "train_bytes_per_token": corpus_summary["train_bytes"] / len(train_stream)},
        **summary,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "evaluation": evaluation,
        "out": str(args.out),
        "size_bytes": sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()),
    }


def _tokenizer(args: argparse.Namespace, corpus: Corpus) -> Tokenizer:
    if args.init_from is None:
        return train_tokenizer((f.text for f in corpus.train), args.vocab_size)
    path = args.init_from / "target" / "tokenizer.json"
    if not path.is_file():
        raise CorpusError(f"--init-from {args.init_from}: no target/tokenizer.json; pass a folder this script wrote")
    return Tokenizer.from_file(str(path))


def _load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Start from a saved model: every parameter of the shape, in float32 (tied head included)."""
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    wrong = [k for k in saved if k not in state or state[k].shape != saved[k].shape]
    wrong += [k for k in state if k not in saved and k not in tied]
    if wrong:
        raise ShapeError(f"--init-from {folder}: {len(wrong)} tensors missing or of another shape (first: {wrong[0]})")
    model.load_state_dict({k: v.float() for k, v in saved.items()}, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def objective(args: argparse.Namespace, name: str, models: dict) -> Objective:
    if name == "draft" and args.draft_loss == "distill":
        return distillation_loss(models["target"], args.bf16)
    return next_token_loss


def evaluate(target, draft, tokenizer: Tokenizer, corpus: Corpus, heldout: torch.Tensor,
             s: ev.EvalSettings) -> dict[str, object]:
    stops = frozenset(tokenizer.token_to_id(t) for t in (END_OF_TEXT, END_OF_TURN))
    long_length = min(target.config.max_position_embeddings, len(heldout) - 1)
    long_windows = ev.stream_windows(heldout, long_length, s.long_windows)
    headers = ev.function_headers(corpus.heldout, s.headers, s.seed)
    return {
        "heldout": ev.window_metrics(target, draft, ev.stream_windows(heldout, s.context, s.windows)),
        "loss_by_position": {"target": ev.loss_by_position(target, long_windows),
                             "draft": ev.loss_by_position(draft, long_windows), "windows": len(long_windows)},
        "speculation": ev.speculation_metrics(target, draft, heldout, s),
        "headers": ev.header_metrics(target, tokenizer, headers, s, stops),
    }


def _report(r) -> dict[str, object]:
    return {"steps": r.steps, "tokens": r.tokens, "seconds": round(r.seconds, 1),
            "tokens_per_second": round(r.tokens_per_second),
            "steady_tokens_per_second": round(r.steady_tokens_per_second), "final_train_loss": r.final_train_loss}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except (CorpusError, ShapeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=2)
    print(text)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
