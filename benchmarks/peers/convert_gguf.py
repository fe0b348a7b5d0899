"""Convert a Hugging Face Qwen3 folder to GGUF with llama.cpp's own converter, with two settings forced.

    CONVERTER_PYTHON convert_gguf.py LLAMA_CPP_SOURCES MODEL_DIR OUT.gguf f32|f16

Runs inside the converter's environment (torch, transformers and llama.cpp's
``gguf`` package), importing ``convert_hf_to_gguf`` from the llama.cpp
sources at run time; nothing of it is copied here. Two of its choices are
wrong for the bundled checkpoint and are overridden around it:

- the pre-tokenizer: the converter recognises a tokenizer by hashing how it
  splits a test string, and the bundled one is not in its table. It is
  GPT-2's byte-level split (``ByteLevel`` with ``use_regex``), so "gpt-2".
- the BOS token: the checkpoint has none (``bos_token: null``) and was
  trained without one, so ``add_bos_token`` is written as false; otherwise
  llama.cpp would prepend a token the other servers do not.

The output type is f32 or f16 only: no quantisation, so the arithmetic stays
comparable with the float32 servers.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(sources: Path, model: Path, out: Path, out_type: str) -> None:
    if out_type not in ("f32", "f16"):
        sys.exit(f"error: output type {out_type!r}: f32 or f16 (no quantisation)")
    sys.path.insert(0, str(sources))
    import gguf
    import convert_hf_to_gguf
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def without_bos(self, writer, quiet=False):
        self.add_special_token["bos"] = False
        return add_to_gguf(self, writer, quiet)

    gguf.SpecialVocab.add_to_gguf = without_bos
    partial = out.with_suffix(".partial")
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(partial), "--outtype", out_type]
    convert_hf_to_gguf.main()
    partial.rename(out)  # the harness takes an existing OUT as a finished conversion


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__.split("\n\n")[1])
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
