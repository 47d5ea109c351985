"""HTTP limits, tried with raw sockets as a hostile client would: heads that never finish
(idle, partial, trickled a byte at a time), bodies that never finish, bodies too large, too
many connections; and Retry-After on every 503."""
from __future__ import annotations

import select
import socket
import time

import httpx
import openai
import pytest

from .conftest import LiveServer

HEADER_S = BODY_S = 1.0
MAX_BYTES = 4096


@pytest.fixture(scope="module")
def limited():
    s = LiveServer(header_timeout_s=HEADER_S, body_timeout_s=BODY_S, max_request_bytes=MAX_BYTES)
    yield s
    s.stop()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _wait_closed(socks: list[socket.socket], deadline: float, trickle: socket.socket | None = None) -> dict:
    """Reads each socket until the server closes it: {sock: bytes received}. Sends a byte
    to `trickle` every 0.2 s meanwhile (a slow-loris head). Sockets still open at the
    deadline are missing from the answer."""
    got = {s: b"" for s in socks}
    open_ = set(socks)
    next_byte = time.monotonic()
    while open_ and time.monotonic() < deadline:
        if trickle is not None and trickle in open_ and time.monotonic() >= next_byte:
            try:
                trickle.send(b"X")
            except OSError:
                pass
            next_byte += 0.2
        ready, _, _ = select.select(list(open_), [], [], 0.05)
        for s in ready:
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if data:
                got[s] += data
            else:
                open_.discard(s)
    return {s: v for s, v in got.items() if s not in open_}


def _open_connections(s: LiveServer) -> int:
    return len(s.uv.server_state.connections)


def test_heads_that_never_finish_are_closed(limited):
    """Idle sockets, partial heads and a head trickled a byte every 0.2 s: all closed
    within the header timeout (the partial ones with a 408), none left on the server."""
    idle = [_connect(limited.port) for _ in range(10)]
    partial = [_connect(limited.port) for _ in range(10)]
    for s in partial:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    slow = _connect(limited.port)
    slow.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
    socks = idle + partial + [slow]
    try:
        t0 = time.monotonic()
        closed = _wait_closed(socks, t0 + HEADER_S + 10, trickle=slow)
        assert len(closed) == len(socks), f"{len(socks) - len(closed)} connections still open"
        assert all(closed[s] == b"" for s in idle)
        assert all(closed[s].startswith(b"HTTP/1.1 408 ") for s in partial + [slow])
        assert b'"invalid_request_error"' in closed[slow]
        deadline = time.monotonic() + 10
        while _open_connections(limited) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _open_connections(limited) == 0
    finally:
        for s in socks:
            s.close()
    assert httpx.get(limited.root + "/health").status_code == 200


def test_a_body_that_never_finishes_gets_408(limited):
    s = _connect(limited.port)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        closed = _wait_closed([s], time.monotonic() + BODY_S + 10)
        assert s in closed, "the connection stayed open"
        head, _, body = closed[s].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"did not arrive" in body
    finally:
        s.close()


def test_bodies_over_the_limit_get_413(limited):
    with pytest.raises(openai.APIStatusError) as e:
        limited.client().completions.create(model="v41-tiny", prompt="x" * (MAX_BYTES + 1), max_tokens=1)
    assert e.value.status_code == 413 and e.value.response.json()["error"]["code"] == "request_too_large"
    # without Content-Length: counted while read
    s = _connect(limited.port)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 1000
        for _ in range(5):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        closed = _wait_closed([s], time.monotonic() + 10)
        assert s in closed and closed[s].startswith(b"HTTP/1.1 413 ")
    finally:
        s.close()
    ok = limited.client().completions.create(model="v41-tiny", prompt="x" * 100, max_tokens=1)
    assert ok.choices[0].finish_reason == "length"


def test_connections_over_the_limit_get_503_with_retry_after():
    s = LiveServer(max_connections=3, header_timeout_s=30)
    held = []
    try:
        held = [_connect(s.port) for _ in range(3)]
        deadline = time.monotonic() + 10
        while _open_connections(s) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(s.root + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections"
        for h in held:
            h.close()
        while _open_connections(s) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(s.root + "/health").status_code == 200
    finally:
        for h in held:
            h.close()
        s.stop()


def test_draining_answers_503_with_retry_after():
    s = LiveServer()
    try:
        s.server.loop.drain()
        r = httpx.get(s.root + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        with pytest.raises(openai.APIStatusError) as e:
            s.client().completions.create(model="v41-tiny", prompt="late", max_tokens=1)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.response.json()["error"]["code"] == "shutting_down"
    finally:
        s.stop()
