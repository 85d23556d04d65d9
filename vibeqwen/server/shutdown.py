"""Stopping the server without losing a reply silently: a grace period for the requests in flight.

On SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the open ones. `GracefulServer` tells
`ShutdownGrace` the moment that starts; `ShutdownGrace.wait` returns `grace_s` seconds later, and every reply
still being generated then ends with a `server_shutting_down` error (streams in-band before `[DONE]`, plain
replies as HTTP 503; see `serving.merge`). A connection still open a few seconds after that (a client that
stalls mid-upload, a stream stuck on a slow reader) is cancelled by uvicorn's `timeout_graceful_shutdown`, so
the process always exits within about `grace_s + 5` seconds of the signal.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn

# Seconds after the grace period at which uvicorn cancels what is still open (sse-starlette's own cancellation
# of an unfinished stream comes first, at STREAM_BACKSTOP_S).
STREAM_BACKSTOP_S = 3.0
CANCEL_AFTER_GRACE_S = 5.0


class ShutdownGrace:
    """When the requests in flight must end: `grace_s` seconds after `begin()`.

    begin() may run in a signal handler; wait() is awaited by the request handlers on the server's event loop.
    """

    def __init__(self, grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError(f"shutdown grace period must be >= 0 seconds, got {grace_s}")
        self.grace_s = grace_s
        self._event = asyncio.Event()  # binds to the loop of its first waiter
        self._loop: asyncio.AbstractEventLoop | None = None

    def begin(self) -> None:
        """The server has begun to shut down (idempotent). Safe in a signal handler that interrupted the loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the loop's thread: the event has no waiter bound yet, or is set from here
            loop = self._loop
        if loop is None:
            self._event.set()
        else:  # a signal handler may have interrupted the loop itself: hand the wake-up to it
            loop.call_soon_threadsafe(self._event.set)

    async def wait(self) -> None:
        """Return `grace_s` seconds after `begin()` (never, if the server does not stop)."""
        self._loop = asyncio.get_running_loop()
        await self._event.wait()
        await asyncio.sleep(self.grace_s)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling `grace` when a signal starts its shutdown."""

    def __init__(self, config: uvicorn.Config, grace: ShutdownGrace) -> None:
        super().__init__(config)
        self.grace = grace
        self.signals: list[int] = []  # the signals that stopped it, in order

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        super().handle_exit(sig, frame)
        self.grace.begin()


def serve(app, grace: ShutdownGrace, **uvicorn_options) -> list[int]:
    """Run `app` under uvicorn until a signal stops it; connections still open `CANCEL_AFTER_GRACE_S` after the
    grace period are cancelled. Returns the signals that stopped it. Raises what uvicorn raises (KeyboardInterrupt
    after Ctrl-C, unless the process was started with SIGINT ignored, as `nohup ... &` starts it)."""
    config = uvicorn.Config(app, timeout_graceful_shutdown=grace.grace_s + CANCEL_AFTER_GRACE_S, **uvicorn_options)
    server = GracefulServer(config, grace)
    server.run()
    return server.signals
