"""Flare beside vLLM's CPU backend and llama.cpp's server, on the same weights and the same client.

    .venv/bin/python -m benchmarks.peers [--quick] [--cache DIR] [--systems ...] [--help]

The peers are installed (and llama.cpp built) at run time into their own
virtual environments under a cache folder, never into the project's
environment; every server is started with matched settings, checked for full
output length and greedy agreement, then driven by ``flare bench``. One table
of medians and ratios to Flare is printed at the end. docs/benchmarks.md says
what each step does and holds the measured table.

Modules, in the order a run uses them:

- ``systems``: the systems compared, their install steps and server command lines (pure).
- ``install``: running those steps, idempotently, with logs and progress.
- ``dataset``: prompts of exactly 128 tokens of the bundled tokenizer.
- ``servers``: starting, checking and stopping a server process.
- ``plan``: the benchmark cells and their interleaved order, and the ``flare bench`` command line (pure).
- ``table``: medians over repetitions, ratios, the printed table (pure).
- ``cli``: the command line; ``__main__`` runs it.
- ``convert_gguf``: runs llama.cpp's own converter inside the converter environment.
- ``random_model``: writes the Qwen3-0.6B-shaped random checkpoint (``--model qwen3-0.6b-random``) and
  measures its decode's memory-bandwidth floor.
- ``decode_step``: one decode step of a captured catalog against that floor and the eager program.
"""
