"""Server processes the tests start (`flare run`, `ignition debug-serve`), on ports the OS gave them.

Every server is started with ``--port 0``: it binds a free port itself before
its warm-up and logs ``ready on http://HOST:PORT``, which ``wait_ready`` reads
back. No port is guessed or picked in advance, so two test runs, or a user's
``flare run`` on 8000, never collide with a test's server.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx

READY = re.compile(r"ready on (http://[^\s:]+:(\d+))")


def start_server(command: list[str], log_path: Path, **popen) -> subprocess.Popen:
    """Start ``command`` (a server taking ``--port``) on a port of the OS's choosing, logging to ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen([*command, "--port", "0"], stdout=log, stderr=subprocess.STDOUT, **popen)


def wait_ready(process: subprocess.Popen, log_path: Path, *, name: str, timeout_s: float) -> str:
    """The server's base URL once it logged where it listens and ``GET /health`` answers 200.

    Fails with the log's tail if the process dies or times out first.
    """
    deadline, base = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        if base is None:
            found = READY.search(log_path.read_text())
            base = found.group(1) if found and int(found.group(2)) > 0 else None
        if base is not None:
            try:
                if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                    return base
            except httpx.TransportError:
                pass
        time.sleep(0.25)
    raise AssertionError(f"{name} not ready after {timeout_s} s:\n{log_path.read_text()[-3000:]}")
