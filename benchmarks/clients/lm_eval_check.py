"""lm-evaluation-harness against ``flare run``: a ``generate_until`` and a ``loglikelihood`` task through
``local-completions``.

    python benchmarks/clients/lm_eval_check.py [--install] [--catalog DIR] [--batch-size 4]

What it does (docs/benchmarks.md, "lm-evaluation-harness"):

1. Uses lm-eval from its own virtual environment, ``CACHE/lm-eval/venv``
   (``CACHE``: ``--cache``, else ``$FLARE_PEERS_CACHE``, else
   ``~/.cache/flare-peers``), never the project's; ``--install`` creates it
   (``python3.11 -m venv``, ``pip install torch==2.13.0``, ``pip install "lm-eval[api]"``: the API models need its extras).
2. Starts ``flare run`` (the bundled model unless ``--catalog``) on a port the
   OS chooses, and writes a small task (a JSONL file and a YAML task made here,
   nothing downloaded) into a temporary folder.
3. Runs ``lm-eval run --model local-completions --batch_size 4`` on it: the
   harness sends each batch of four prompts as one request with a list of
   prompts, greedy, with the task's stop string.
4. Checks what came back: every document answered, the batches really were
   lists of prompts (the server's access log names each choice
   ``cmpl-ID-INDEX``), and each batched answer equals the answer of the same
   prompt sent alone. Prints the harness's table and those figures.
5. The same for a ``multiple_choice`` task, which the harness scores with
   ``loglikelihood`` requests: batches of four token-id prompts with ``echo:
   true, logprobs: 1, max_tokens: 1`` (scored prefill). lm-eval needs the
   model's tokenizer to find where each context ends; it loads it from a local
   folder (``tokenizer_backend=huggingface``, ``--tokenizer``, default the
   bundled model's), never from the hub. Each (logprob, is_greedy) lm-eval
   reports must equal what the same request sent alone gives.

Exit status: 0 when the check passed, 1 when an answer differs or is missing,
2 when something could not be set up (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
TASK = "flare_check_generate"
CHOICE_TASK = "flare_check_choice"
BUNDLED_TOKENIZER = REPO / "ignition" / "models" / "bundled" / "flare-tiny" / "target"
STOP = "\n"
MAX_GEN_TOKS = 16
READY = re.compile(r"ready on (http://[^\s:]+:(\d+)) \(model (\S+)\)")
CHOICE_ID = re.compile(r"request_id=(cmpl-[0-9a-f]+)(?:-(\d+))? endpoint=completions status=(\d+)")
QUESTIONS = [  # (prompt, the answer a capable model would give): the plumbing is checked, not the model
    ("The capital of France is", " Paris"), ("Two plus two equals", " four"),
    ("The opposite of hot is", " cold"), ("The color of the sky on a clear day is", " blue"),
    ("The first month of the year is", " January"), ("A baby cat is called a", " kitten"),
    ("Water freezes at zero degrees", " Celsius"), ("The day after Monday is", " Tuesday"),
    ("Once upon a time, there was a", " little"), ("def add(a, b):\n    return", " a + b"),
]
CHOICES = [  # (context, continuations, the right one): three loglikelihood requests per document
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
    ("import", [" os", " numpy", " the"], 0),
    ("for i in", [" range(10):", " the list", " 42"], 0),
    ("The capital of France is", [" Paris", " London", " Rome"], 0),
    ("class Point:\n    def", [" __init__(self, x, y):", " main()", " return"], 0),
    ("if __name__ ==", [" \"__main__\":", " 'main'", " 0:"], 0),
    ("x = [1, 2,", [" 3]", " 3)", " three"], 0),
]


class SetupError(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return check(args)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Run lm-evaluation-harness (local-completions, generate_until) "
                                                 "against flare run.")
    default_cache = os.environ.get("FLARE_PEERS_CACHE") or str(Path.home() / ".cache" / "flare-peers")
    parser.add_argument("--cache", type=Path, default=Path(default_cache), help="folder holding lm-eval/venv")
    parser.add_argument("--install", action="store_true", help="create the lm-eval environment if it is missing")
    parser.add_argument("--catalog", type=Path, default=None, help="catalog folder (default: the bundled model)")
    parser.add_argument("--batch-size", type=int, default=4, help="lm-eval's --batch_size (prompts per request)")
    parser.add_argument("--tokenizer", type=Path, default=BUNDLED_TOKENIZER,
                        help="local folder of the served model's tokenizer, for the loglikelihood task "
                             "(default: the bundled model's)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (task, outputs, server log)")
    return parser


def check(args: argparse.Namespace) -> int:
    lm_eval = _lm_eval(args.cache / "lm-eval" / "venv", args.install)
    folder = Path(tempfile.mkdtemp(prefix="flare-lm-eval-"))
    _write_task(folder)
    log = folder / "server.log"
    server, base, model = _start_flare(args.catalog, log)
    try:
        started = time.monotonic()
        harness = _run_harness(lm_eval, base, model, folder, args.batch_size, TASK, _text_requests())
        seconds = time.monotonic() - started
        samples = _samples(folder / "out", TASK)
        alone = [_answer_alone(base, model, sample["arguments"]["gen_args_0"]["arg_0"]) for sample in samples]
        generate_log = log.read_text(errors="replace")
        started = time.monotonic()
        scored = _run_harness(lm_eval, base, model, folder, args.batch_size, CHOICE_TASK, _token_requests(args.tokenizer))
        choice_seconds = time.monotonic() - started
        choice_samples = _samples(folder / "out", CHOICE_TASK)
        choice_log = log.read_text(errors="replace")[len(generate_log):]
        scored_alone = [[_score_alone(base, model, context, continuation) for context, continuation in _pairs(sample)]
                        for sample in choice_samples]
    finally:
        _stop(server)
    print(harness)
    passed = _report(samples, alone, _batches(generate_log), args.batch_size, seconds)
    print(scored)
    passed &= _report_scores(choice_samples, scored_alone, _batches(choice_log), args.batch_size, choice_seconds)
    print("lm-eval check: " + ("PASSED" if passed else "FAILED"))
    if args.keep or not passed:
        print(f"files kept in {folder}")
    else:
        _remove(folder)
    return 0 if passed else 1


def _lm_eval(venv: Path, install: bool) -> Path:
    program = venv / "bin" / "lm-eval"
    if program.exists():
        return program
    if not install:
        raise SetupError(f"no lm-eval at {program}; run with --install to create {venv}")
    for step in ([sys.executable if sys.version_info[:2] == (3, 11) else "python3.11", "-m", "venv", str(venv)],
                 [str(venv / "bin" / "pip"), "install", "torch==2.13.0"],
                 [str(venv / "bin" / "pip"), "install", "lm-eval[api]"]):
        print("$ " + " ".join(step), flush=True)
        if subprocess.run(step).returncode != 0:
            raise SetupError(f"installing lm-eval failed at: {' '.join(step)}")
    return program


def _write_task(folder: Path) -> None:
    with open(folder / "questions.jsonl", "w") as out:
        for prompt, answer in QUESTIONS:
            out.write(json.dumps({"question": prompt, "answer": answer}) + "\n")
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'questions.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps([STOP])}
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    with open(folder / "choices.jsonl", "w") as out:
        for context, continuations, gold in CHOICES:
            out.write(json.dumps({"context": context, "choices": continuations, "gold": gold}) + "\n")
    (folder / f"{CHOICE_TASK}.yaml").write_text(f"""task: {CHOICE_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'choices.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def _start_flare(catalog: Path | None, log: Path) -> tuple[subprocess.Popen, str, str]:
    command = [sys.executable, "-m", "helios.cli", "run", *([str(catalog)] if catalog else []), "--port", "0",
               "--threads", "1", "--log-stats-interval", "0"]
    print("$ " + " ".join(command), flush=True)
    env = os.environ | {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                   start_new_session=True)
    deadline = time.monotonic() + 1800  # a first run captures the bundled catalog: minutes
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SetupError(f"flare run exited with {process.returncode}; its log: {log}")
        found = READY.search(log.read_text(errors="replace"))
        if found:
            return process, found.group(1), found.group(3)
        time.sleep(0.5)
    _stop(process)
    raise SetupError(f"flare run not ready after 30 minutes; its log: {log}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _text_requests() -> list[str]:
    """generate_until needs no tokenizer: the harness sends text."""
    return ["tokenizer_backend=none", "tokenized_requests=False"]


def _token_requests(tokenizer: Path) -> list[str]:
    """loglikelihood needs the context's length in tokens: the harness tokenizes with the model's own
    tokenizer, loaded from a local folder (the hub is off), and sends token ids."""
    if not (tokenizer / "tokenizer.json").is_file():
        raise SetupError(f"{tokenizer}: no tokenizer.json (--tokenizer names the served model's tokenizer folder)")
    return ["tokenizer_backend=huggingface", f"tokenizer={tokenizer.resolve()}", "tokenized_requests=True"]


def _run_harness(lm_eval: Path, base: str, model: str, folder: Path, batch_size: int, task: str,
                 requests: list[str]) -> str:
    model_args = ",".join([f"model={model}", f"base_url={base}/v1/completions", *requests,
                           "num_concurrent=1", "max_retries=1", "timeout=600"])
    command = [str(lm_eval), "run", "--model", "local-completions", "--model_args", model_args,
               "--tasks", task, "--include_path", str(folder), "--batch_size", str(batch_size),
               "--output_path", str(folder / "out"), "--log_samples"]
    print("$ " + " ".join(command), flush=True)
    # offline: the task's data is the local file written above, and nothing else may be fetched
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder)
    (folder / f"lm-eval-{task}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise SetupError(f"lm-eval exited with {done.returncode}: {tail[0][:300]} (log {folder / f'lm-eval-{task}.log'})")
    return done.stdout


def _samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SetupError(f"lm-eval wrote no samples under {out}")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def _answer_alone(base: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_GEN_TOKS, "temperature": 0, "stop": [STOP],
            "seed": 1234}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=600.0)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def _pairs(sample: dict) -> list[tuple[str, str]]:
    """A multiple-choice sample's (context, continuation) loglikelihood requests, in choice order."""
    args = sample["arguments"]
    return [(args[key]["arg_0"], args[key]["arg_1"]) for key in sorted(args, key=lambda k: int(k.rsplit("_", 1)[1]))]


def _score_alone(base: str, model: str, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval computes for one (context, continuation), asked alone: the continuation's logprob
    sum over ``echo`` + ``logprobs: 1``, and whether each of its tokens was the most likely."""
    whole, ctx = _tokens(base, context + continuation), _tokens(base, context)
    body = {"model": model, "prompt": whole, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "seed": 1234}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=600.0)
    reply.raise_for_status()
    logprobs = reply.json()["choices"][0]["logprobs"]
    scores, tops = logprobs["token_logprobs"][len(ctx):-1], logprobs["top_logprobs"][len(ctx):-1]
    return sum(scores), all(s == max(top.values()) for s, top in zip(scores, tops))


def _tokens(base: str, text: str) -> list[int]:
    reply = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60.0)
    reply.raise_for_status()
    return reply.json()["tokens"]


def _batches(log: str) -> Counter:
    """How many requests the harness sent of each size (choices per response id), from the access log."""
    sizes: Counter = Counter()
    for response_id, index, _ in CHOICE_ID.findall(log):
        sizes[response_id] = max(sizes[response_id], int(index or 0) + 1)
    return Counter(sizes.values())


def _report(samples: list[dict], alone: list[str], batches: Counter, batch_size: int, seconds: float) -> bool:
    batched = [sample["resps"][0][0] for sample in samples]
    same = sum(a == b for a, b in zip(batched, alone))
    print(f"documents: {len(QUESTIONS)}, answered by lm-eval: {len(samples)}, in {seconds:.1f} s")
    print("requests by prompts per request: " + ", ".join(f"{size}: {count}" for size, count in sorted(batches.items())))
    print(f"batched answers equal to the same prompt sent alone: {same} of {len(samples)}")
    for sample, text, single in zip(samples, batched, alone):
        if text != single:
            print(f"  differs: {sample['arguments']['gen_args_0']['arg_0']!r}: batched {text!r}, alone {single!r}")
    largest = max(batches, default=0)
    passed = len(samples) == len(QUESTIONS) and same == len(samples) and largest == min(batch_size, len(QUESTIONS))
    print("lm-eval generate_until check: " + ("PASSED" if passed else "FAILED"))
    return passed


def _report_scores(samples: list[dict], alone: list[list[tuple[float, bool]]], batches: Counter, batch_size: int,
                   seconds: float) -> bool:
    """The loglikelihood half: every request answered, batched, and equal to the same request alone."""
    requests = sum(len(c) for _, c, _ in CHOICES)
    # the samples file writes each response as strings: ["-10.93...", "False"]
    batched = [[(float(r[0][0]), str(r[0][1]) == "True") for r in sample["resps"]] for sample in samples]
    pairs = [(b, a) for bs, al in zip(batched, alone) for b, a in zip(bs, al)]
    same = sum(b == a for b, a in pairs)
    print(f"documents: {len(CHOICES)}, answered by lm-eval: {len(samples)}, loglikelihood requests: "
          f"{len(pairs)} of {requests}, in {seconds:.1f} s")
    print("requests by prompts per request: " + ", ".join(f"{size}: {count}" for size, count in sorted(batches.items())))
    print(f"batched (logprob, is_greedy) equal to the same request sent alone: {same} of {len(pairs)}")
    for sample, scores, single in zip(samples, batched, alone):
        if scores != single:
            print(f"  differs: {sample['arguments']['gen_args_0']['arg_0']!r}: batched {scores}, alone {single}")
    largest = max(batches, default=0)
    passed = len(pairs) == requests and same == requests and largest == min(batch_size, requests)
    print("lm-eval loglikelihood check: " + ("PASSED" if passed else "FAILED"))
    return passed


def _remove(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir()


if __name__ == "__main__":
    sys.exit(main())
