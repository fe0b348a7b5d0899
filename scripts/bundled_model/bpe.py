"""A byte-level BPE tokenizer trained on the corpus, with the bundled models' special tokens.

Byte-level means every byte string encodes (no unknown token); the merges make
common Python spellings (``self.``, ``    def``, ``return``) single tokens. The
special tokens and chat template are the byte tokenizer's, so the runtime's
end-of-sequence and chat handling work unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ignition.models.byte_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

END_OF_TEXT, END_OF_TURN = SPECIAL_TOKENS[0], SPECIAL_TOKENS[2]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Special tokens take ids 0..2; the 256 byte symbols always enter the vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_tokenizer(folder: Path, tokenizer: Tokenizer, max_length: int) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": END_OF_TURN,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS),
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
