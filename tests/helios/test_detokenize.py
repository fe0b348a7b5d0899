"""Incremental detokenization and stop buffering (helios.runtime.detokenize)."""

from __future__ import annotations

import pytest

from helios.runtime.detokenize import IncrementalDecoder, OutputText, StopBuffer


class Bytes:
    """Token ids are UTF-8 bytes; 256 is a special token that decodes to nothing."""

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_multibyte_characters_split_across_tokens_are_never_emitted_broken():
    decoder = IncrementalDecoder(Bytes())
    pieces = [decoder.add([b]) for b in "añ€😀!".encode()]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == "añ€😀!"
    assert pieces[1] == ""  # the first byte of ñ alone is incomplete


def test_invalid_bytes_are_released_once_no_later_token_could_complete_them():
    decoder = IncrementalDecoder(Bytes())
    pieces = [decoder.add([0xE7]) for _ in range(8)]  # lead bytes that never get their continuation
    assert "".join(pieces).count("\ufffd") >= 4  # not held to the end of the output
    assert "".join(pieces) + decoder.flush() == "\ufffd" * 8


def test_special_tokens_add_no_text():
    decoder = IncrementalDecoder(Bytes())
    assert decoder.add(list(b"hi")) == "hi"
    assert decoder.add([256]) == ""


@pytest.mark.parametrize("split", [1, 2, 3])
def test_a_stop_string_split_across_tokens_is_never_delivered(split):
    text = OutputText(Bytes(), ["STOP"])
    data = b"hello STOP world"
    delivered, stopped = "", False
    for i in range(0, len(data), split):
        released = text.add(list(data[i:i + split]))
        delivered += released.text
        if released.stopped:
            stopped = True
            break
    assert stopped and delivered == "hello "


def test_text_that_might_become_a_stop_is_held_then_released_when_it_cannot():
    stops = StopBuffer(["abc"])
    assert stops.push("xa").text == "x"
    assert stops.push("b").text == ""  # "ab" may still become "abc"
    assert stops.push("d").text == "abd"


def test_finish_releases_held_text_when_no_stop_completes():
    text = OutputText(Bytes(), ["</end>"])
    assert text.add(list(b"done </e")).text == "done "
    final = text.finish()
    assert final.text == "</e" and not final.stopped


def test_the_earliest_of_several_stop_strings_wins():
    stops = StopBuffer(["world", "lo w"])
    released = stops.push("hello world")
    assert released.stopped and released.text == "hel"
