"""The HTTP transport: uvicorn with read timeouts, a connection limit, a body bound and a
draining shutdown.

    limits = HTTPLimits(header_timeout_s=10, body_timeout_s=60, max_request_bytes=32 << 20,
                        max_connections=512)
    app = BodyLimit(app, limits)                   # innermost: 413 / 408 on the body
    http = HTTPServer(uvicorn_config(app, limits, host=..., port=..., drain_s=30),
                      drain=loop.drain, stop=loop.stop, drain_s=30)
    http.run()                                     # returns on SIGTERM / SIGINT, drained

uvicorn alone keeps a connection that never finishes its request head open for ever (no
header timeout; its keep-alive timer starts only after a first response), accepts any
number of connections, reads bodies of any size and, on SIGTERM, re-raises the signal
after serving so that nothing after `run()` (closing the cache, which commits queued SSD
writes) ever runs. Here:

- Header timeout: a connection must deliver a complete request head within
  header_timeout_s of opening or of its previous response, however slowly it trickles
  bytes in; otherwise it is closed (with a 408 if it had started a request). This also
  bounds idle keep-alive connections.
- Body timeout and size: BodyLimit reads the whole body before the app sees it, within
  body_timeout_s of the head (408 otherwise) and at most max_request_bytes (413, at once
  when Content-Length says so).
- Connection limit: a connection opened while max_connections are already open has its
  requests answered 503 with Retry-After and is closed.
- Shutdown: SIGTERM and SIGINT both drain: listeners close, new requests get 503, those
  in flight may finish until drain_s (less a short grace, when what is left is failed
  with a final "shutting down" error their handlers can still send), then uvicorn cancels
  what remains and run() returns normally. A second signal stops waiting at once.

The limits apply to uvicorn's h11 protocol, which the server always uses (its own class,
below), whatever uvicorn would pick by default.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import APIError, send_error

__all__ = ["HTTPLimits", "BodyLimit", "HTTPServer", "uvicorn_config", "protocol_class"]

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s")


@dataclass(frozen=True)
class HTTPLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_request_bytes: int = 32 << 20
    max_connections: int = 512

    def __post_init__(self):
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("the header and body timeouts must be > 0 seconds")
        if self.max_request_bytes < 1 or self.max_connections < 1:
            raise ValueError("max_request_bytes and max_connections must be >= 1")


def _timeout_response() -> bytes:
    import json

    body = json.dumps(APIError(408, "the request head did not arrive in time").body()).encode()
    return _TIMEOUT_408 % (len(body), body)


async def _refuse(scope, receive, send) -> None:
    """The app of a connection over the limit: 503, Retry-After, close."""
    await send_error(send, APIError(503, "too many open connections; retry later", code="too_many_connections"),
                     close=True)


def protocol_class(limits: HTTPLimits) -> type:
    """uvicorn's h11 protocol with the header timeout and the connection limit."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_timer: asyncio.TimerHandle | None = None
            self.head_bytes = 0
            if len(self.connections) > limits.max_connections:
                self.app = _refuse           # uvicorn runs self.app for each request it parses
            self._arm()

        def data_received(self, data: bytes) -> None:
            self.head_bytes += len(data)
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()               # a whole head arrived: the request is the app's now

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()                  # the next head has header_timeout_s, too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.head_bytes = 0
            self.head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_timeout(self) -> None:
            self.head_timer = None
            if self.transport.is_closing():
                return
            if self.head_bytes:
                self.transport.write(_timeout_response())
            self.transport.close()

    return GuardedH11Protocol


class BodyLimit:
    """ASGI middleware: the request body, whole, within body_timeout_s and
    max_request_bytes, then handed to the app as one message."""

    def __init__(self, app, limits: HTTPLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        cap = self.limits.max_request_bytes
        too_big = APIError(413, f"the request body is larger than this server's limit of {cap} bytes",
                           code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            return await send_error(send, too_big, close=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await send_error(send, APIError(408, f"the request body did not arrive within "
                                                            f"{self.limits.body_timeout_s:g} s"), close=True)
            if msg["type"] == "http.disconnect":
                return
            size += len(msg.get("body", b""))
            if size > cap:
                return await send_error(send, too_big, close=True)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()           # then: the disconnect, when it comes

        await self.app(scope, replay, send)


def uvicorn_config(app, limits: HTTPLimits, *, host: str = "127.0.0.1", port: int = 8000,
                   drain_s: float = 30.0, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits), lifespan="off",
                          log_level=log_level, timeout_graceful_shutdown=drain_s,
                          timeout_keep_alive=5)


class HTTPServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM and SIGINT drain (module docstring) and are not
    re-raised: run() returns, so the caller closes the engine and the cache."""

    def __init__(self, config: uvicorn.Config, *, drain=None, stop=None, drain_s: float = 30.0):
        super().__init__(config)
        self.drain, self.stop, self.drain_s = drain, stop, drain_s
        self.signals: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self.signals.append(sig)
        if self.should_exit:
            self.force_exit = True           # a second signal: stop waiting
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.drain is not None:
            self.drain()
        timer = None
        if self.stop is not None:
            grace = min(1.0, self.drain_s / 4)
            timer = asyncio.get_running_loop().call_later(max(0.0, self.drain_s - grace), self.stop)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

