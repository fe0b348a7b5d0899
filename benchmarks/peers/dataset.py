"""The one dataset every system gets: prompts of exactly ``input_len`` tokens of the bundled tokenizer.

``flare bench``'s own datasets estimate lengths; here each prompt is the
start of a standard-library ``.py`` file (the bundled model's domain), cut at
``input_len`` tokens and kept only if its text encodes back to exactly those
tokens, so every server (all three use this tokenizer) sees the same ids. The
servers' ``usage.prompt_tokens`` is checked against it after every run.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer


def build(tokenizer_file: Path, out: Path, count: int, input_len: int, output_len: int, seed: int) -> list[str]:
    """Write ``count`` JSONL requests (``prompt``, ``output_len``) to ``out`` and return the prompts."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    sources = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 4096)
    random.Random(seed).shuffle(sources)
    prompts = []
    for path in sources:
        if (prompt := exact_prefix(tokenizer, path.read_text(errors="replace"), input_len)) is not None:
            prompts.append(prompt)
        if len(prompts) == count:
            break
    assert len(prompts) == count, f"only {len(prompts)} of {count} standard-library files give {input_len}-token prompts"
    out.write_text("".join(json.dumps({"prompt": p, "output_len": output_len}) + "\n" for p in prompts))
    return prompts


def exact_prefix(tokenizer: Tokenizer, text: str, length: int) -> str | None:
    """The text of the first ``length`` tokens of ``text`` if it re-encodes to exactly them, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:length]
    if len(ids) < length:
        return None
    prefix = tokenizer.decode(ids, skip_special_tokens=False)
    return prefix if tokenizer.encode(prefix, add_special_tokens=False).ids == ids else None
