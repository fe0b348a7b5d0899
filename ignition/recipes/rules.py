"""Field rules for recipe dataclasses, kept as ``dataclasses.field`` metadata.

Each rule is ``{"check": value -> problem | None, "allowed": words}``; the
loader reports ``<file>: <field>: <problem>; allowed: <words>``. The bucket
rules are shared with ``ignition.capacity`` so a CLI override is judged by the
same words as a recipe field.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Iterable
from typing import Any

Check = Callable[[Any], str | None]

PROMPT_ALIGNMENT = 64  # spec C7: prompt capacities are positive multiples of 64
_IDENTIFIER = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict = 2, 4, 4
_QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 60, 60, 40


def quote(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut for a one-line message: a recipe is user text, and a value may be huge."""
    text = _QUOTE.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rule(check: Check, allowed: str) -> dict[str, Any]:
    return {"check": check, "allowed": allowed}


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def positive() -> dict[str, Any]:
    def check(v: float) -> str | None:
        if not math.isfinite(v):
            return f"{v} is not finite"
        return None if v > 0 else f"{v} is not positive"

    return rule(check, "a positive, finite number")


def at_least(low: int) -> dict[str, Any]:
    return rule(lambda v: None if v >= low else f"{v} is below {low}", f"an integer >= {low}")


def between(low: int, high: int) -> dict[str, Any]:
    return rule(
        lambda v: None if low <= v <= high else f"{v} is outside {low}..{high}",
        f"an integer from {low} through {high}",
    )


def power_of_two_between(low: int, high: int) -> dict[str, Any]:
    def check(v: int) -> str | None:
        if not is_power_of_two(v) or not low <= v <= high:
            return f"{v} is not a power of two in {low}..{high}"
        return None

    return rule(check, f"a power of two from {low} through {high}")


def one_of(choices: Iterable[str]) -> dict[str, Any]:
    choices = tuple(choices)
    return rule(lambda v: None if v in choices else f"{quote(v)} is not supported", "one of " + ", ".join(choices))


def subset_of(choices: Iterable[str]) -> dict[str, Any]:
    choices = tuple(choices)

    def check(values: tuple[str, ...]) -> str | None:
        unknown = [v for v in values if v not in choices]
        if unknown:
            return f"unknown {', '.join(map(quote, unknown[:3]))}"
        return _duplicates(values)

    return rule(check, "a list drawn from " + ", ".join(choices))


def identifier() -> dict[str, Any]:
    return rule(
        lambda v: None if _IDENTIFIER.match(v) else f"{quote(v)} is not a plain name",
        "lower-case letters, digits, '.', '_' and '-'",
    )


def identifiers() -> dict[str, Any]:
    def check(values: tuple[str, ...]) -> str | None:
        bad = [v for v in values if not _IDENTIFIER.match(v)]
        return f"{quote(bad[0])} is not a plain name" if bad else _duplicates(values)

    return rule(check, "a list of names made of lower-case letters, digits, '.', '_' and '-'")


def prompt_bucket_problem(value: int) -> str | None:
    if value < PROMPT_ALIGNMENT or value % PROMPT_ALIGNMENT:
        return f"{value} is not a positive multiple of {PROMPT_ALIGNMENT}"
    return None


def prompt_buckets() -> dict[str, Any]:
    def check(values: tuple[int, ...]) -> str | None:
        if not values:
            return "the list is empty"
        return _first(map(prompt_bucket_problem, values)) or _ascending(values)

    return rule(check, f"a non-empty ascending list of positive multiples of {PROMPT_ALIGNMENT}, e.g. [64, 256, 1024]")


def request_buckets(high: int) -> dict[str, Any]:
    def check(values: tuple[int, ...]) -> str | None:
        bad = [v for v in values if not is_power_of_two(v) or v > high]
        if bad:
            return f"{bad[0]} is not a power of two in 1..{high}"
        return _ascending(values)

    return rule(check, f"an ascending list of powers of two through {high}, e.g. [1, 2, 4]")


def _ascending(values: tuple[int, ...]) -> str | None:
    for earlier, later in zip(values, values[1:]):
        if later <= earlier:
            return f"{later} does not follow {earlier} in strictly ascending order"
    return None


def _duplicates(values: tuple[str, ...]) -> str | None:
    seen: set[str] = set()
    for v in values:
        if v in seen:
            return f"{quote(v)} is listed twice"
        seen.add(v)
    return None


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p), None)
