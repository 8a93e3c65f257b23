"""A graceful stop for ``gmlx serve``: SIGTERM or Ctrl-C drains the server.

On the first signal the server stops taking requests (each new one, ``/health``
included, gets a 503 ``server_shutting_down`` in its route's protocol, so a load
balancer moves on) and gives the requests in flight a grace period to finish. Those
still running when it ends are cut with that typed error: a stream ends with its
protocol's error event, never with a normal finish, so no client takes a truncated
answer for a complete one. Then uvicorn stops as usual (the port is released) and the
process exits 0. A second signal cuts the requests in flight at once, the same way
(their streams still end with the error event, and the log says so in one line, not
with a traceback per cancelled task); a third stops without waiting for anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gmlx.engine.errors import ShuttingDownError
from gmlx.server.errors import error_response, protocol_for

log = logging.getLogger("gmlx.server")

CUT_WAIT_S = 5.0  # after the cut: how long the cut responses get to send their error
# How long an idle keep-alive connection stays open: longer than clients keep theirs in
# their pools (httpx, under the OpenAI and Anthropic SDKs: 5 s; Node's fetch: 4 s), so the
# client closes first. At uvicorn's default of 5 s the two expire together, and a request
# sent on a connection as the server closes it fails with "Server disconnected without
# sending a response" (the SDKs retry it; a client with no retries does not).
KEEP_ALIVE_S = 75


class Drain:
    """ASGI wrapper that counts the HTTP requests in flight and, once ``draining``,
    refuses new ones with a 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            error = ShuttingDownError("The server is shutting down and takes no new requests.",
                                      headers={"Retry-After": "10", "Connection": "close"})
            await error_response(error, protocol_for(scope["path"]))(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no request to be in flight; whether none is."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self.in_flight == 0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM or SIGINT (see the module docstring).

    Args:
        config: uvicorn's config, whose app is a :class:`Drain`.
        workers: returns the model workers whose requests a cut ends.
        timeout: the grace period in seconds.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, workers: Any, timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.workers = workers
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._cutting: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Take SIGTERM and SIGINT while serving; unlike uvicorn, do not raise them
        again afterwards (a drained server exits 0)."""
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self._loop is None or self._cutting is not None:  # not serving yet, or a third signal
            self.should_exit = self.force_exit = True
        elif self._stopping is None:
            self._stopping = self._loop.create_task(self._drain(name))
        else:  # a second signal: the grace period ends now
            self._cutting = self._loop.create_task(self._cut(
                f"a second {name}: stopping now", "The server was stopped before this request finished."))

    async def _drain(self, why: str) -> None:
        drain = self.drain
        drain.draining = True
        log.info("%s: shutting down; %d requests in flight get up to %g s to finish",
                 why, drain.in_flight, self.timeout)
        if not await drain.idle(self.timeout) and self._cutting is None:
            await self._cut("shutting down", "The server shut down before this request finished "
                                             f"(grace period {self.timeout:g} s).")
        self.should_exit = True

    async def _cut(self, why: str, message: str) -> None:
        """End every request in flight with a typed error saying ``message`` (a stream
        with its protocol's error event), give the responses ``CUT_WAIT_S`` to send it,
        then stop."""
        if self.drain.in_flight:
            log.warning("%s: cutting %d requests still in flight", why, self.drain.in_flight)
        error = ShuttingDownError(message)
        for worker in self.workers():
            worker.abort(error)
        await self.drain.idle(CUT_WAIT_S)
        self.should_exit = True


def serve(app: Any, host: str, port: int, shutdown_timeout: float) -> bool:
    """Serve ``app`` (a server app from ``gmlx.compose.build_app``) until SIGTERM or
    Ctrl-C, draining for up to ``shutdown_timeout`` seconds. Returns whether it started
    (False: the address could not be bound)."""
    drain = Drain(app)
    config = uvicorn.Config(drain, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=CUT_WAIT_S, timeout_keep_alive=KEEP_ALIVE_S)
    server = GracefulServer(config, drain, app.state.registry.workers, shutdown_timeout)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C before the server took the signal
        server.run()
    return server.started
