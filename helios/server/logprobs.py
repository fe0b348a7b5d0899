"""Output logprobs in the two OpenAI response shapes.

The engine hands each output token's ``TokenLogprob`` (the raw model
distribution's log-probability, and its best alternatives, as the programs
computed them) along with the token ids of a delta. Here they become:

- ``/v1/completions`` (``logprobs: N``): ``{tokens, token_logprobs,
  top_logprobs, text_offset}``, where ``top_logprobs[i]`` maps the token
  strings of the N best alternatives, plus the sampled token itself, to their
  logprobs (vLLM's choice: the sampled token always appears, so a dict may
  hold N + 1 entries; with N = 0 it holds only the sampled token), and
  ``text_offset[i]`` is the character offset of token i's string in the
  concatenation of the token strings, counted across a stream's chunks.
- ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs: N``):
  ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}`` with exactly N alternatives.

A token's string is its own decoded text (part of a character decodes as
U+FFFD, as in vLLM); ``bytes`` are the raw bytes the token stands for when
the tokenizer can say (byte-level BPE), else the UTF-8 of that string.
"""

from __future__ import annotations

from collections.abc import Sequence

from helios.runtime.engine_api import EngineTokenizer, TokenLogprob


class _Tokens:
    """Token strings and bytes, each looked up once per request."""

    def __init__(self, tokenizer: EngineTokenizer) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self._tokenizer.decode([token_id])
        return self._text[token_id]

    def bytes(self, token_id: int) -> list[int]:
        raw = getattr(self._tokenizer, "token_bytes", None)
        return list(raw(token_id) if raw is not None else self.text(token_id).encode("utf-8"))


class CompletionLogprobs:
    """One completion's ``logprobs`` objects; ``text_offset`` runs on across calls (stream chunks)."""

    def __init__(self, tokenizer: EngineTokenizer, top: int, offset: int = 0) -> None:
        self._tokens = _Tokens(tokenizer)
        self._top = top
        self._offset = offset

    def body(self, items: Sequence[TokenLogprob]) -> dict:
        return self.echoed((), (), items)

    def echoed(self, prompt_ids: Sequence[int], prompt_scores: Sequence[TokenLogprob | None],
               items: Sequence[TokenLogprob]) -> dict:
        """The object over the echoed prompt's tokens, then the output's: a prompt token without a score
        (the first) has null ``token_logprobs`` and ``top_logprobs`` entries, as in vLLM."""
        entries = [*zip(prompt_ids, prompt_scores), *((item.token_id, item) for item in items)]
        tokens, offsets, tops = [], [], []
        for token_id, item in entries:
            text = self._tokens.text(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            tops.append(None if item is None else self._top_of(text, item))
        return {"tokens": tokens, "token_logprobs": [None if item is None else item.logprob for _, item in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _top_of(self, text: str, item: TokenLogprob) -> dict:
        top = {self._tokens.text(a.token_id): a.logprob for a in item.top[: self._top]}
        top.setdefault(text, item.logprob)
        return top


def prompt_logprobs_body(tokenizer: EngineTokenizer, scores: Sequence[TokenLogprob | None], top: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {logprob, rank,
    decoded_token}}``, the prompt token first, then the ``top`` best alternatives. ``rank`` is null for a
    prompt token beyond the 20 alternatives the programs rank."""
    tokens = _Tokens(tokenizer)
    body: list = []
    for item in scores:
        if item is None:
            body.append(None)
            continue
        entry = {str(item.token_id): {"logprob": item.logprob, "rank": item.rank,
                                      "decoded_token": tokens.text(item.token_id)}}
        for rank, a in enumerate(item.top[:top], start=1):
            entry.setdefault(str(a.token_id), {"logprob": a.logprob, "rank": rank,
                                               "decoded_token": tokens.text(a.token_id)})
        body.append(entry)
    return body


class ChatLogprobs:
    """One chat completion's ``logprobs`` objects (``content`` entries for the given tokens)."""

    def __init__(self, tokenizer: EngineTokenizer, top: int) -> None:
        self._tokens = _Tokens(tokenizer)
        self._top = top

    def body(self, items: Sequence[TokenLogprob]) -> dict:
        return {"content": [self._entry(item.token_id, item.logprob)
                            | {"top_logprobs": [self._entry(a.token_id, a.logprob) for a in item.top[: self._top]]}
                            for item in items]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self._tokens.text(token_id), "logprob": logprob, "bytes": self._tokens.bytes(token_id)}


LogprobsFormat = CompletionLogprobs | ChatLogprobs
