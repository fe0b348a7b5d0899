"""lm-evaluation-harness against ``flare run``: a ``generate_until`` task through ``local-completions``.

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
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (task, outputs, server log)")
    return parser


def check(args: argparse.Namespace) -> int:
    lm_eval = _lm_eval(args.cache / "lm-eval" / "venv", args.install)
    folder = Path(tempfile.mkdtemp(prefix="flare-lm-eval-"))
    _write_task(folder)
    server, base, model = _start_flare(args.catalog, folder / "server.log")
    try:
        started = time.monotonic()
        harness = _run_harness(lm_eval, base, model, folder, args.batch_size)
        seconds = time.monotonic() - started
        samples = _samples(folder / "out")
        alone = [_answer_alone(base, model, sample["arguments"]["gen_args_0"]["arg_0"]) for sample in samples]
    finally:
        _stop(server)
    batches = _batches((folder / "server.log").read_text(errors="replace"))
    print(harness)
    return _report(samples, alone, batches, args.batch_size, seconds, folder, args.keep)


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


def _run_harness(lm_eval: Path, base: str, model: str, folder: Path, batch_size: int) -> str:
    model_args = ",".join([f"model={model}", f"base_url={base}/v1/completions", "tokenizer_backend=none",
                           "tokenized_requests=False", "num_concurrent=1", "max_retries=1", "timeout=600"])
    command = [str(lm_eval), "run", "--model", "local-completions", "--model_args", model_args,
               "--tasks", TASK, "--include_path", str(folder), "--batch_size", str(batch_size),
               "--output_path", str(folder / "out"), "--log_samples"]
    print("$ " + " ".join(command), flush=True)
    # offline: the task's data is the local file written above, and nothing else may be fetched
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder)
    (folder / "lm-eval.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise SetupError(f"lm-eval exited with {done.returncode}: {tail[0][:300]} (log {folder / 'lm-eval.log'})")
    return done.stdout


def _samples(out: Path) -> list[dict]:
    files = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    if not files:
        raise SetupError(f"lm-eval wrote no samples under {out}")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def _answer_alone(base: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_GEN_TOKS, "temperature": 0, "stop": [STOP],
            "seed": 1234}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=600.0)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def _batches(log: str) -> Counter:
    """How many requests the harness sent of each size (choices per response id), from the access log."""
    sizes: Counter = Counter()
    for response_id, index, _ in CHOICE_ID.findall(log):
        sizes[response_id] = max(sizes[response_id], int(index or 0) + 1)
    return Counter(sizes.values())


def _report(samples: list[dict], alone: list[str], batches: Counter, batch_size: int, seconds: float,
            folder: Path, keep: bool) -> int:
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
    if keep or not passed:
        print(f"files kept in {folder}")
    else:
        _remove(folder)
    return 0 if passed else 1


def _remove(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir()


if __name__ == "__main__":
    sys.exit(main())
