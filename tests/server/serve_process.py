"""The real `vibeqwen serve` process for end-to-end tests: started on a free port, waited for until /health is 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args: list[str], timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`python -m vibeqwen serve ARGS --port <free>`, stdout and stderr piped to `proc.stdout` (text). Returns (the
    process, its base URL) once /health answers 200; fails the test if it exits first or takes over `timeout` s."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vibeqwen", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"server did not become healthy in {timeout:.0f} s")


def stop_serve(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM the server, then kill it if it has not exited within `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
