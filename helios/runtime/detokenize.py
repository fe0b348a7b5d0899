"""Incremental detokenization and stop strings with stop buffering.

Two small pieces the engine runs per request, in the control thread:

- ``IncrementalDecoder`` turns a growing list of token ids into text deltas.
  Byte-level tokenizers split multi-byte characters across tokens; decoding
  only a window of recent tokens and holding text back while it ends in an
  incomplete character (U+FFFD) keeps the cost per token constant and never
  emits a broken character that a later token would repair. Bytes that no
  later token can complete (a model emitting invalid UTF-8) are released as
  U+FFFD once a character's longest byte span has passed.
- ``StopBuffer`` applies stop strings. Text that could still grow into a stop
  string is held back until it cannot; once a stop string appears, the text
  before it is released and the stop string itself is not, unless asked
  (``include_stop``, vLLM's ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT = "\ufffd"
MAX_CHARACTER_TOKENS = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens


class Decodes(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalDecoder:
    """Text deltas of a token stream (special tokens decode to nothing)."""

    def __init__(self, tokenizer: Decodes) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # first id of the window decoded for context
        self._read = 0  # ids before this are already emitted as text

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        incomplete = after.endswith(REPLACEMENT) and len(self._ids) - self._read < MAX_CHARACTER_TOKENS
        if len(after) <= len(before) or incomplete:
            return ""  # nothing new yet, or a character that a later token may still complete
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete character decodes as U+FFFD)."""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):] if len(after) > len(before) else ""


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class Released:
    """Text safe to deliver now, and whether a stop string ended the output."""

    text: str
    stopped: bool = False


class StopBuffer:
    """Holds back text that may still become a stop string; cuts at the first stop string."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._include = include_stop  # vLLM's include_stop_str_in_output: release the stop string too
        self._held = ""

    def push(self, text: str) -> Released:
        pending = self._held + text
        found = [(i, -len(s)) for s in self._stops if (i := pending.find(s)) >= 0]
        if found:
            cut, longest = min(found)  # the earliest stop string; of those starting there, the longest
            self._held = ""
            return Released(pending[: cut - longest if self._include else cut], stopped=True)
        keep = self._partial_suffix(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return Released(pending[: len(pending) - keep])

    def flush(self) -> str:
        """The held text, once the output ended for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class OutputText:
    """One request's output: incremental decoding followed by stop buffering."""

    def __init__(self, tokenizer: Decodes, stops: Sequence[str], include_stop: bool = False) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._stops = StopBuffer(stops, include_stop)

    def add(self, token_ids: Sequence[int]) -> Released:
        return self._stops.push(self._decoder.add(token_ids))

    def finish(self) -> Released:
        """The output ended without a stop string so far: release everything, still honouring stops."""
        released = self._stops.push(self._decoder.flush())
        if released.stopped:
            return released
        return Released(released.text + self._stops.flush())
