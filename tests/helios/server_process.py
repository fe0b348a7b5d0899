"""Servers the tests start (`flare run`, `ignition debug-serve`, uvicorn in a thread), on ports the OS gave them.

Every server is started with ``--port 0``: it binds a free port itself before
its warm-up and logs ``ready on http://HOST:PORT``, which ``wait_ready`` reads
back. No port is guessed or picked in advance, so two test runs, or a user's
``flare run`` on 8000, never collide with a test's server.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def serving_in_thread(server) -> Iterator[str]:
    """Run a uvicorn ``server`` (``helios.server.serve.uvicorn_server``) in a thread on a loopback port
    the OS chose; yields its base URL and stops it afterwards."""
    # proto IPPROTO_TCP, as uvicorn's own sockets have: asyncio sets TCP_NODELAY only then,
    # and without it every keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not shut down"


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s`` (a safety net, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
