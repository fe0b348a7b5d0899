"""Driving a real engine in-process from a synchronous test."""

from __future__ import annotations

import asyncio


def serve(engine, body, timeout_s: float = 120.0):
    """Run ``body(engine)`` (a coroutine function) inside a started engine and stop it afterwards."""
    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), timeout_s)
        finally:
            await engine.stop()
    return asyncio.run(main())
