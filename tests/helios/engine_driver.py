"""Driving a real engine in-process from a synchronous test."""

from __future__ import annotations

import asyncio
import time


def serve(engine, body, timeout_s: float = 120.0):
    """Run ``body(engine)`` (a coroutine function) inside a started engine and stop it afterwards."""
    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), timeout_s)
        finally:
            await engine.stop()
    return asyncio.run(main())


def wait_idle(engine, timeout_s: float = 20.0):
    """The engine's stats once nothing runs, waits or holds a page; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.requests_running == 0 and stats.requests_waiting == 0 and stats.kv_pages_used == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")
