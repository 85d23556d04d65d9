"""Shutting the server down (SIGTERM, as Ctrl-C or an orchestrator sends) while a streamed response runs: the real
`vibeqwen serve` process on the tiny checkpoint. Within `--shutdown-grace-period` the stream finishes as usual; past
it the stream ends with an in-band error (code "server_shutting_down") and `[DONE]`, never silently. The grace
logic itself (every request aborted, the error raised) is also checked on `merge` directly."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

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
