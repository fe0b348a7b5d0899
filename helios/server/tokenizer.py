"""``EngineTokenizer`` over a checkpoint's tokenizer files (tokenizer.json + tokenizer_config.json).

What a real engine exposes as ``engine.tokenizer``: the ``tokenizers`` fast
tokenizer for text and ids, and the config's chat template rendered with
Jinja (``ChatTemplate``). The catalog ships these files (DESIGN.md, "The
catalog artifact"), so the same class serves the bundled model and local
Hugging Face checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from helios.engine_api import ChatTemplateError
from helios.server.chat_template import ChatTemplate


class CheckpointTokenizer:
    """Thread-safe for the server's use: encoding runs in worker threads."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self._tokenizer = tokenizer
        self._template = template

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
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ChatTemplateError("this checkpoint's tokenizer_config.json has no chat_template; use /v1/completions")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt)


def _template(config: Path) -> ChatTemplate | None:
    """The chat template, or None for checkpoints without one (chat requests then get a 400)."""
    try:
        return ChatTemplate.from_tokenizer_config(config)
    except (ChatTemplateError, FileNotFoundError):
        return None
