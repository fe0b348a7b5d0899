"""The pure parts of scripts/scheduling_sim/e2e_transformers.py: the prompt set, batching, output counting.

The timed comparison itself is a benchmark script (it prints figures); nothing here times anything.
"""

import pytest
from tokenizers import Tokenizer

from scripts.scheduling_sim.e2e_transformers import (
    MODEL_DIR,
    E2eError,
    batches,
    fixed_length_prompts,
    generated_length,
    main,
    parse_batch_sizes,
)

SOURCES = [
    "def add(a, b):\n    return a + b\n" * 40,
    "import os\n\nclass Thing:\n    pass\n" * 40,
    "x = 1\n",  # too short for any length used below: must never be picked
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def test_prompts_are_exactly_the_requested_tokens_and_encode_back_to_their_ids(tokenizer):
    prompts = fixed_length_prompts(tokenizer, SOURCES, count=6, length=50, seed=3)
    assert len(prompts) == 6
    for prompt in prompts:
        assert len(prompt.ids) == 50
        # The server tokenizes the text; it must see the very ids transformers is given.
        assert tuple(tokenizer.encode(prompt.text).ids) == prompt.ids
        assert prompt.text != "x = 1\n"


def test_prompt_set_is_seeded(tokenizer):
    first = fixed_length_prompts(tokenizer, SOURCES, count=8, length=20, seed=1)
    again = fixed_length_prompts(tokenizer, SOURCES, count=8, length=20, seed=1)
    assert first == again
    others = [fixed_length_prompts(tokenizer, SOURCES, count=8, length=20, seed=s) for s in range(2, 6)]
    assert any(other != first for other in others)


def test_prompt_length_no_source_holds_is_one_clear_error(tokenizer):
    with pytest.raises(E2eError, match="--input-len 100000"):
        fixed_length_prompts(tokenizer, SOURCES, count=2, length=100_000, seed=0)
    with pytest.raises(E2eError, match="--num-prompts 0"):
        fixed_length_prompts(tokenizer, SOURCES, count=0, length=10, seed=0)


def test_batch_sizes_parse_and_bad_ones_name_the_flag():
    assert parse_batch_sizes("1,4, 16") == (1, 4, 16)
    for bad in ("0", "4,x", "", "-1"):
        with pytest.raises(E2eError, match="--batch-size"):
            parse_batch_sizes(bad)


def test_static_batches_keep_order_and_the_last_may_be_short():
    assert batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert batches(list(range(4)), 4) == [[0, 1, 2, 3]]


def test_generated_length_counts_through_the_first_end_token():
    assert generated_length([5, 6, 9, 7, 9], eos=9) == 3
    assert generated_length([5, 6, 7], eos=9) == 3
    assert generated_length([9, 9], eos=9) == 1
    assert generated_length([5, 6], eos=None) == 2


def test_bad_batch_size_exits_2_with_one_line(capsys):
    assert main(["--batch-size", "0"]) == 2
    assert "--batch-size '0'" in capsys.readouterr().err
