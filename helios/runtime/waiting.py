"""The line of requests that were submitted and have no slot yet (``flare run --max-waiting``, ``--queue-timeout``).

Two threads touch it, each with its own counters, so no lock is needed:
``reserve`` runs on the event loop when a request is submitted and refuses
it at once when the line is full; everything else runs on the engine's
control thread, which appends the request when it handles the submission and
takes it out when it gets a slot, is cancelled or has waited too long. The
line's length is reservations minus departures, so a submission the control
thread has not handled yet already counts: a burst is bounded as it arrives.
So that a burst into an idle engine is not refused for requests about to get
a slot, ``reserve`` is told how many slots are free; the event loop reads
that while the control thread may be admitting, so at such an instant the
bound may be off by the requests being admitted.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import Generic, TypeVar

from helios.runtime.engine_api import EngineOverloaded

DEFAULT_MAX_WAITING = 256
RETRY_AFTER_S = 1  # what a refused client is told: the line moves every time a request finishes

T = TypeVar("T")


class WaitingLine(Generic[T]):
    """FIFO of waiting requests: at most ``limit``, each for at most ``timeout_s`` (None: no timeout)."""

    def __init__(self, limit: int = DEFAULT_MAX_WAITING, timeout_s: float | None = None) -> None:
        if limit < 1:
            raise ValueError(f"max_waiting must be >= 1 (requests waiting for a slot), got {limit}")
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"queue_timeout_s must be None (wait as long as it takes) or a finite number > 0, got {timeout_s}")
        self.limit = limit
        self.timeout_s = timeout_s
        self._line: collections.deque[tuple[T, float]] = collections.deque()  # (request, when it joined)
        self._reserved = 0  # event loop only
        self.refused = 0  # event loop only
        self._departed = 0  # control thread only
        self.timed_out = 0  # control thread only

    def waiting(self) -> int:
        """Requests submitted and without a slot, those not yet appended included (any thread)."""
        return self._reserved - self._departed

    def reserve(self, free_slots: int = 0) -> None:
        """Count one more submission, or raise ``EngineOverloaded`` when the line is full (event loop).

        Full means ``limit`` requests beyond those that ``free_slots`` will take.
        """
        if self.waiting() >= self.limit + max(0, free_slots):
            self.refused += 1
            raise EngineOverloaded(f"{self.limit} requests are already waiting for a slot "
                                   f"(flare run --max-waiting); retry in {RETRY_AFTER_S} s", RETRY_AFTER_S)
        self._reserved += 1

    # -- control thread ------------------------------------------------------

    def append(self, item: T, now: float) -> None:
        self._line.append((item, now))

    def popleft(self) -> T:
        self._departed += 1
        return self._line.popleft()[0]

    def remove(self, item: T) -> None:
        index = next(i for i, (waiting, _) in enumerate(self._line) if waiting is item)
        del self._line[index]
        self._departed += 1

    def clear(self) -> None:
        self._departed += len(self._line)
        self._line.clear()

    def expired(self, now: float) -> list[T]:
        """Take out the requests that have waited longer than ``timeout_s`` (the oldest are first)."""
        gone: list[T] = []
        while self._line and self.timeout_s is not None and now - self._line[0][1] >= self.timeout_s:
            gone.append(self.popleft())
        self.timed_out += len(gone)
        return gone

    def until_expiry(self, now: float) -> float | None:
        """Seconds until the oldest request expires (None: nothing can expire)."""
        if self.timeout_s is None or not self._line:
            return None
        return max(0.0, self._line[0][1] + self.timeout_s - now)

    def __getitem__(self, index: int) -> T:
        return self._line[index][0]

    def __len__(self) -> int:
        return len(self._line)

    def __iter__(self) -> Iterator[T]:
        return (item for item, _ in self._line)
