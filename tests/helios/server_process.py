"""Waiting for a server process the tests started (`flare run`, `ignition debug-serve`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_ready(base: str, process: subprocess.Popen, log_path: Path, *, name: str, timeout_s: float) -> None:
    """Return once ``GET base/health`` answers 200; fail with the log's tail if the process dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{name} not ready after {timeout_s} s:\n{log_path.read_text()[-3000:]}")
