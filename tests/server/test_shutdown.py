"""Shutting the server down (SIGTERM, as Ctrl-C or an orchestrator sends) while replies run: the real
`vibeqwen serve` process on the tiny checkpoint. Within `--shutdown-grace-period` a stream finishes as usual; past
it the stream ends with an in-band error (code "server_shutting_down") and `[DONE]`, never silently, and a plain
reply is an HTTP 503 with that code. A client stalled mid-upload does not keep the server alive, and a second
Ctrl-C quits without a crash. The grace logic itself (every request aborted, the error raised) is also checked on
`merge` directly."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from serve_process import start_serve

from vibeqwen.server.serving import APIError, merge


def _serve(checkpoint, grace: float) -> tuple[subprocess.Popen, str]:
    # two prompt tokens a step: a long prompt keeps its request busy for seconds
    return start_serve(["--weights", str(checkpoint), "--max-num-batched-tokens", "2", "--max-model-len", "2048",
                        "--shutdown-grace-period", str(grace), "--served-model-name", "shut",
                        "--reasoning-parser", "none"])


def _stream_then_sigterm(proc, base: str, prompt_words: int, max_tokens: int) -> list:
    """Start a streamed chat, send SIGTERM once its first event has arrived, return every `data:` payload."""
    body = {"model": "shut", "messages": [{"role": "user", "content": "hello " * prompt_words}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    events = []
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                proc.kill()
                pytest.fail(f"HTTP {r.status_code}: {r.read()!r}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)
    finally:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the server did not exit within 60 s of SIGTERM")
    return events


@pytest.mark.parametrize("grace", [0.0, 60.0], ids=["cut", "finish"])
def test_sigterm_during_a_stream(tiny_checkpoint, grace):
    proc, base = _serve(tiny_checkpoint, grace)
    # cut: ~2000 prompt tokens at 2 a step, far longer than no grace at all; finish: a short request
    events = _stream_then_sigterm(proc, base, 1000 if grace == 0 else 40, 4)
    out = proc.stdout.read()
    assert events and events[-1] == "[DONE]", (events, out[-2000:])
    if grace == 0:
        err = events[-2]["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable", events
        assert not any(c["choices"][0].get("finish_reason") for c in events[:-2] if c.get("choices")), events
    else:
        finish = [c["choices"][0]["finish_reason"] for c in events[:-1] if c.get("choices")]
        assert finish[-1] == "length" and not any("error" in c for c in events[:-1]), events
    # a clean shutdown; uvicorn re-raises the signal it handled once it has finished, so the exit status may be it
    assert proc.returncode in (0, -signal.SIGTERM) and "Finished server process" in out, out[-2000:]


def _wait_running(base: str, timeout: float = 30) -> None:
    """Until /metrics shows a request in the running batch."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = httpx.get(base + "/metrics", timeout=5).text
        line = next(x for x in text.splitlines() if x.startswith("vibeqwen:num_requests_running"))
        if float(line.split()[-1]) >= 1:
            return
        time.sleep(0.05)
    pytest.fail("no request started running")


def _exit_status(proc, timeout: float) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the server did not exit within {timeout:.0f} s:\n{proc.stdout.read()[-2000:]}")
    return proc.returncode, proc.stdout.read()


def test_sigterm_ends_a_plain_reply_with_503(tiny_checkpoint):
    proc, base = _serve(tiny_checkpoint, 0.5)
    body = {"model": "shut", "prompt": "hello " * 1000, "max_tokens": 4, "temperature": 0}
    got = {}
    client = threading.Thread(target=lambda: got.update(r=httpx.post(base + "/v1/completions", json=body,
                                                                      timeout=120)))
    client.start()
    _wait_running(base)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    client.join(60)
    took = time.monotonic() - t0
    code, out = _exit_status(proc, 60)
    r = got["r"]
    assert r.status_code == 503, (r.status_code, r.text, out[-2000:])
    err = r.json()["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable", err
    assert took < 10, took  # the grace period, not the ~2000-token prompt at 2 tokens a step
    assert code in (0, -signal.SIGTERM) and "Finished server process" in out, out[-2000:]


def test_a_stalled_upload_does_not_hold_the_server(tiny_checkpoint):
    proc, base = _serve(tiny_checkpoint, 0.0)
    url = urlparse(base)
    with socket.create_connection((url.hostname, url.port)) as sock:
        # headers promising a body that never comes
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"model\": ")
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code, out = _exit_status(proc, 60)
    assert time.monotonic() - t0 < 20, out[-2000:]  # grace 0 + 5 s, not forever
    assert code in (0, -signal.SIGTERM) and "Finished server process" in out, out[-2000:]


def test_ctrl_c_stops_with_status_130_and_no_traceback(tiny_checkpoint):
    proc, base = _serve(tiny_checkpoint, 0.0)
    proc.send_signal(signal.SIGINT)
    code, out = _exit_status(proc, 60)
    # the shell's status for a process that SIGINT ended (as SIGTERM's is 143), after a clean stop
    assert code == 130 and "Traceback" not in out and "Finished server process" in out, (code, out[-2000:])


def test_second_ctrl_c_quits_without_a_crash(tiny_checkpoint):
    proc, base = _serve(tiny_checkpoint, 60.0)
    body = {"model": "shut", "prompt": "hello " * 1000, "max_tokens": 4, "temperature": 0}
    client = threading.Thread(target=lambda: httpx.post(base + "/v1/completions", json=body, timeout=120),
                              daemon=True)
    client.start()
    _wait_running(base)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # force quit: the request is still running in the engine thread
    code, out = _exit_status(proc, 60)
    # it used to abort (SIGABRT, "terminate called without an active exception"): the interpreter exited under
    # the engine thread's running step
    assert code != -signal.SIGABRT and "terminate called" not in out, (code, out[-2000:])


def test_merge_stop_aborts_every_request():
    closed = []

    async def never(i):
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            closed.append(i)

    async def main():
        stopped = asyncio.Event()

        async def stop():
            await stopped.wait()

        got = []
        it = merge([never(0), never(1)], stop)
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0.05)
        assert not task.done()
        stopped.set()
        with pytest.raises(APIError) as e:
            got.append(await task)
        await it.aclose()
        return e.value, got

    err, got = asyncio.run(main())
    assert err.status_code == 503 and err.info.code == "server_shutting_down" and got == []
    assert sorted(closed) == [0, 1]  # both requests' iterators closed: AsyncEngine.generate aborts them then
    # one request with a stop: the same path (not the single-stream shortcut)
    closed.clear()

    async def one():
        async def stop():
            return None

        with pytest.raises(APIError):
            async for _ in merge([never(7)], stop):
                pass

    asyncio.run(one())
    assert closed == [7]
