"""Bucket arithmetic: request buckets, prompt buckets, the balanced prompt bucket."""

from __future__ import annotations

from fractions import Fraction


def padded(concurrency: int) -> int:
    """The smallest power of two >= concurrency (3 -> 4)."""
    return 1 << max(concurrency - 1, 0).bit_length()


def request_buckets_through(concurrency: int, declared: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Power-of-two batch capacities ending at the padded concurrency (spec C5).

    ``declared`` (a recipe's explicit list) thins the ladder; the top bucket is
    always the padded concurrency so every slot can run at once.
    """
    top = padded(concurrency)
    ladder = declared or tuple(1 << i for i in range(top.bit_length()))
    return tuple(b for b in ladder if b < top) + (top,)


def prompt_buckets_through(declared: tuple[int, ...], chunk: int | None) -> tuple[int, ...]:
    """The recipe's prompt buckets capped at ``--prefill-chunk``; the chunk itself is the top bucket."""
    if chunk is None:
        return declared
    return tuple(b for b in declared if b < chunk) + (chunk,)


def balanced_prompt_bucket(buckets: tuple[int, ...]) -> int:
    """The bucket T minimizing max(T / T_min, T_max / T); ties go to the smaller (spec C8).

    It keeps the worst multiplicative distance to both the shortest and the
    longest prompt chunk small: near the geometric mean of the extremes.
    """
    low, high = min(buckets), max(buckets)
    return min(sorted(buckets), key=lambda t: max(Fraction(t, low), Fraction(high, t)))
