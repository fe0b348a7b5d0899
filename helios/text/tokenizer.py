"""``EngineTokenizer`` over a checkpoint's tokenizer files (tokenizer.json + tokenizer_config.json).

What a real engine exposes as ``engine.tokenizer``: the ``tokenizers`` fast
tokenizer for text and ids, and the config's chat template rendered with
Jinja (``ChatTemplate``). The catalog ships these files (DESIGN.md, "The
catalog artifact"), so the same class serves the bundled model and local
Hugging Face checkpoints.

Encoding goes through ``encode_batch_fast``: the ``tokenizers`` library
releases the GIL in its batch calls but holds it for the whole of a plain
``encode``, so a worker thread tokenizing megabytes with ``encode`` stalls
the event loop and every stream with it (issue 17: 6 s gaps).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from helios.runtime.engine_api import ChatTemplateError
from helios.text.chat_template import ChatTemplate


class CheckpointTokenizer:
    """Thread-safe for the server's use: encoding runs in worker threads."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self._tokenizer = tokenizer
        self._template = template
        # Without GIL-releasing batch calls (tokenizers < 0.20) encoding falls back to the plain call.
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.max_token_bytes = max_token_bytes(json.loads(tokenizer.to_str()))

    @classmethod
    def from_folder(cls, folder: Path) -> CheckpointTokenizer:
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (a checkpoint or catalog tokenizer folder needs one)")
        return cls(Tokenizer.from_file(str(tokenizer_file)), _template(folder / "tokenizer_config.json"))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        [encoding] = self._encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs' ``bytes``): a byte-level BPE token's raw bytes, which
        may be part of a character; otherwise the UTF-8 of its decoded text."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is not None and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError("this checkpoint's tokenizer_config.json has no chat_template; use /v1/completions")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     template_kwargs=template_kwargs)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (GPT-2's scheme): printable Latin-1
    bytes stand for themselves, the other bytes for the code points from 256 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_OF = _byte_level_alphabet()


def _template(config: Path) -> ChatTemplate | None:
    """The chat template, or None for checkpoints without one (chat requests then get a 400)."""
    try:
        return ChatTemplate.from_tokenizer_config(config)
    except (ChatTemplateError, FileNotFoundError):
        return None


# What may stand between the text and the tokens without deleting any of it. Unicode
# normalization and lower-casing may shrink UTF-8 up to fourfold (U+1D400, four bytes, becomes
# "A" under NFKC; U+212A KELVIN SIGN, three bytes, lower-cases to "k"); Prepend only adds.
_SHRINKING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_KEEPING_NORMALIZERS = frozenset({"Prepend"})
_NORMALIZER_SHRINK = 4
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"})


def max_token_bytes(spec: dict) -> int | None:
    """The most UTF-8 bytes of input text one token can stand for, from a parsed tokenizer.json.

    None where no such bound holds: truncation, a normalizer or pre-tokenizer
    that may delete text (Strip, Replace, Whitespace, a ``Removed`` split),
    or a model whose unknown token swallows a whole word (WordPiece,
    WordLevel, Unigram, BPE with ``fuse_unk``). Under byte-level BPE every
    vocabulary character stands for one byte; elsewhere a token's UTF-8
    spelling is never shorter than the text it stands for (``▁`` for a
    space, ``<0x41>`` for a byte). Added tokens match their literal text.
    """
    model = spec.get("model") or {}
    if spec.get("truncation") is not None or model.get("type") != "BPE" or not _bpe_unknowns_bounded(model):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    pre = _pre_tokenizer_types(spec.get("pre_tokenizer"))
    if shrink is None or pre is None:
        return None
    per_char = "ByteLevel" in pre
    vocab = max((len(token) if per_char else len(token.encode()) for token in model.get("vocab", {})), default=1)
    added = max((len(token["content"].encode()) for token in spec.get("added_tokens", ())), default=1)
    unknown = 4 if model.get("unk_token") is not None else 1  # one unknown character per token, at most 4 bytes
    return max(vocab, added, unknown) * shrink


def _bpe_unknowns_bounded(model: dict) -> bool:
    return model.get("unk_token") is None or bool(model.get("byte_fallback")) or not model.get("fuse_unk")


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """How many times the normalizer may shrink UTF-8 text (1: never), or None if it may delete text."""
    parts = [] if normalizer is None else normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    kinds = {part.get("type") for part in parts}
    if not kinds <= _SHRINKING_NORMALIZERS | _KEEPING_NORMALIZERS:
        return None
    return _NORMALIZER_SHRINK if kinds & _SHRINKING_NORMALIZERS else 1


def _pre_tokenizer_types(pre: dict | None) -> set[str] | None:
    """The pre-tokenizers' types, or None if one of them may drop text."""
    parts = [] if pre is None else pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if any(part.get("type") not in _KEEPING_PRE_TOKENIZERS or part.get("behavior") == "Removed" for part in parts):
        return None
    return {part["type"] for part in parts}
