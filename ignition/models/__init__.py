"""Model code for capture (never imported by helios at run time).

qwen3.py           Qwen3 config and the packed, paged forward (weights as input)
checkpoint.py      load a local Hugging Face-format folder (ModelLoadError)
sampling.py        in-graph sampling seeded by (seed, position, token id)
frame.py           one packed frame: rows, forward, sampling, verification, slot-state commit
proposals.py       the draft's part: learned proposals, prefix_limit allocation, survival, absorption
packing.py         packed-row geometry (prefix-sum offsets, C14)
programs.py        GraphDescriptor -> ProgramSpec (module, example args, signature)
byte_tokenizer.py  a byte-level tokenizer: the chat template and special tokens the bundled BPE reuses
bundled/           the trained flare-tiny target and draft (scripts/train_bundled_model.py, docs/bundled-model.md)
"""
