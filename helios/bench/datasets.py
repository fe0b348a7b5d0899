"""What to send: random word prompts, CPython's own standard-library sources, or a JSONL file.

The benchmark does not know the server's tokenizer, so prompt lengths here
are estimates (``estimated_prompt_tokens``); the server's ``usage`` gives the
real counts. Random prompts are words from a small list that common BPE
vocabularies hold as one token each; python-files prompts take about four
characters per token.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

CHARS_PER_TOKEN = 4  # rough figure for source code under BPE tokenizers
WORDS = tuple(
    "the of and to in is was for on that with as by at from his an were are which this be or had not but "
    "one have they you all their has been more when there time can her would about into only other new some "
    "could these two may first then any like over also after many must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three".split()
)


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file, the line and what is expected."""


@dataclass(frozen=True, slots=True)
class LengthRange:
    """Inclusive token range, drawn uniformly."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, flag: str) -> LengthRange:
        """``A:B`` or ``N``; both bounds positive and A <= B."""
        parts = text.split(":")
        if len(parts) <= 2 and all(part.strip().isdigit() for part in parts):
            low, high = int(parts[0]), int(parts[-1])
            if 1 <= low <= high:
                return cls(low, high)
        raise DatasetError(f"{flag} {text!r}: expected N or A:B with 1 <= A <= B (token counts)")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: a prompt (completions) or messages (chat), and its max output tokens."""

    prompt: str | None
    messages: tuple[dict, ...] | None
    output_len: int
    estimated_prompt_tokens: int

    def chat_messages(self) -> list[dict]:
        return list(self.messages) if self.messages is not None else [{"role": "user", "content": self.prompt}]


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str  # "random", "python-files" or a path to a .jsonl file
    count: int
    input_len: LengthRange
    output_len: LengthRange
    seed: int


def load_requests(spec: DatasetSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    if spec.name == "random":
        return [_random_request(spec, rng) for _ in range(spec.count)]
    if spec.name == "python-files":
        return _python_file_requests(spec, rng)
    if spec.name.endswith(".jsonl"):
        return _jsonl_requests(Path(spec.name), spec, rng)
    raise DatasetError(f"--dataset {spec.name!r}: expected random, python-files or a FILE.jsonl path")


def _random_request(spec: DatasetSpec, rng: random.Random) -> BenchRequest:
    length = spec.input_len.draw(rng)
    prompt = " ".join(rng.choice(WORDS) for _ in range(length))
    return BenchRequest(prompt, None, spec.output_len.draw(rng), length)


def stdlib_sources() -> list[Path]:
    """The interpreter's own standard-library .py files, top level only, sorted (non-empty ones)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in root.glob("*.py") if path.stat().st_size > 0)


def _python_file_requests(spec: DatasetSpec, rng: random.Random) -> list[BenchRequest]:
    sources = stdlib_sources()
    if not sources:
        raise DatasetError(f"--dataset python-files: no .py files under {sysconfig.get_paths()['stdlib']}")
    requests = []
    for path in rng.choices(sources, k=spec.count):
        tokens = spec.input_len.draw(rng)
        text = path.read_text(errors="replace")[: tokens * CHARS_PER_TOKEN]
        prompt = f"# {path.name}\n{text}"
        requests.append(BenchRequest(prompt, None, spec.output_len.draw(rng), len(prompt) // CHARS_PER_TOKEN))
    return requests


def _jsonl_requests(path: Path, spec: DatasetSpec, rng: random.Random) -> list[BenchRequest]:
    """Lines in file order, the file repeated when it has fewer than ``count`` lines."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise DatasetError(f"--dataset {path}: cannot read it ({exc.strerror})") from None
    if not lines:
        raise DatasetError(f"--dataset {path}: the file has no requests (one JSON object per line expected)")
    parsed = [_jsonl_request(path, number, line, spec, rng) for number, line in enumerate(lines, 1)]
    return [parsed[i % len(parsed)] for i in range(spec.count)]


def _jsonl_request(path: Path, number: int, line: str, spec: DatasetSpec, rng: random.Random) -> BenchRequest:
    where = f"--dataset {path} line {number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected an object with 'prompt' or 'messages'")
    output_len = item.get("output_len", spec.output_len.draw(rng))
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise DatasetError(f"{where}: 'output_len' must be a positive integer, got {output_len!r}")
    prompt, messages = item.get("prompt"), item.get("messages")
    if isinstance(prompt, str) and messages is None:
        return BenchRequest(prompt, None, output_len, len(prompt) // CHARS_PER_TOKEN)
    if prompt is None and _are_messages(messages):
        chars = sum(len(m["content"]) for m in messages)
        return BenchRequest(None, tuple(messages), output_len, chars // CHARS_PER_TOKEN)
    raise DatasetError(f"{where}: expected either 'prompt' (a string) or 'messages' "
                       "(a list of {'role': str, 'content': str}), not both")


def _are_messages(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
