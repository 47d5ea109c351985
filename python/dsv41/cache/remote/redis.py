"""Redis (or Valkey) backend: `redis://[USER:PASSWORD@]HOST:PORT/DB` (rediss:// for TLS).

Values are plain strings. Values without a TTL (blocks) are written with one MSET and read
with one MGET per batch, whose reply is read straight into the rows of the caller's record
array (get_into: no bytes object per value, none of redis-py's buffer copies). A pipeline
goes out with sendmsg, many buffers per syscall. With a TTL, puts are `SET k v PX ttl` (NX unless overwriting) and
hits `GETEX k PX ttl`, pipelined, so a value lives for ttl since its last use; configure
the server with `maxmemory-policy volatile-lru` so only such values are evicted. Per-tenant
ACL users restricted to their key prefix: docs/remote.md.

Calls run in the caller's thread (`bounds_itself`) while an open connection is at hand:
every send and every read of the replies (the backend parses them itself, RESP2 and RESP3)
waits at most what is left of the call's deadline, so a server that stops answering or a
link that trickles costs a call its deadline and no more, and Guarded needs no worker
thread, and no handoff to one, for them. Only connections that served their last call
whole are kept open; one that met any error is closed and dropped. A call that would have
to open a connection (the first ones, after an error, more concurrent calls than
connections) raises RemoteNotReady in the caller's thread and Guarded runs it in a worker,
where the connect and redis-py's handshake are bounded by socket_timeout_s (2 s), so that
the new connection is kept for later calls even when the caller stopped waiting.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Sequence

import numpy as np

from .base import RemoteBackend, RemoteError, RemoteNotReady, RemoteTimeout

__all__ = ["RedisBackend", "SMALL_VALUE_BYTES"]

SMALL_VALUE_BYTES = 6000   # larger arguments are sent as chunks of their own (redis-py's cutoff too)


def _pack(commands: list[tuple]) -> list:
    """The commands in the Redis protocol (RESP), as a list of chunks to send in order.
    An argument is str, int, a bytes-like object, or a tuple of bytes-like parts sent as one
    value (their concatenation). Large values and parts go out as chunks of their own,
    unchanged (no copy); everything else is gathered into few buffers."""
    chunks: list = []
    buf = bytearray()
    for cmd in commands:
        buf += b"*%d\r\n" % len(cmd)
        for a in cmd:
            if isinstance(a, str):
                a = a.encode()
            elif isinstance(a, int):
                a = b"%d" % a
            pieces = a if isinstance(a, tuple) else (a,)
            buf += b"$%d\r\n" % sum(len(x) for x in pieces)
            for x in pieces:
                if len(x) > SMALL_VALUE_BYTES:
                    chunks.append(buf)
                    chunks.append(x)
                    buf = bytearray()
                else:
                    buf += x
            buf += b"\r\n"
    chunks.append(buf)
    return chunks


_IOV_MAX = 1024   # buffers per sendmsg (Linux's IOV_MAX)
_MAX_BULK = 512 << 20   # Redis's proto-max-bulk-len default: no value it sends is longer


def _left(end: float) -> float:
    """Seconds until `end` (time.monotonic()), or socket.timeout once it has passed."""
    t = end - time.monotonic()
    if t <= 0:
        raise socket.timeout("deadline passed")
    return t


def _send(sock, chunks: list, end: float) -> None:
    """Sends the chunks in order with as few syscalls as the socket takes: sendmsg gathers
    up to _IOV_MAX of them per call (redis-py sends each chunk with a sendall of its own,
    ~65 syscalls for an MSET of 32 v41-flash blocks). TLS sockets, which have no sendmsg,
    get one sendall per chunk. Each call waits at most until `end` (time.monotonic()): a
    peer that takes the bytes slowly cannot stretch the send past it. socket.timeout is
    redis.TimeoutError, any other OSError redis.ConnectionError, as in redis-py."""
    import ssl

    import redis
    try:
        if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
            for c in chunks:
                sock.settimeout(_left(end))   # sendall's timeout bounds the whole chunk
                sock.sendall(c)
            return
        views = []
        for c in chunks:
            m = memoryview(c)
            if m.ndim != 1 or m.format != "B":
                m = m.cast("B")
            if len(m):
                views.append(m)
        i = 0
        while i < len(views):
            sock.settimeout(_left(end))
            sent = sock.sendmsg(views[i: i + _IOV_MAX])
            while sent:   # drop what went out; a partly sent buffer goes again from where it stopped
                if sent >= len(views[i]):
                    sent -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
    except socket.timeout as e:
        raise redis.TimeoutError("Timeout writing to socket") from e
    except OSError as e:
        raise redis.ConnectionError(f"Error while writing to socket: {e}") from e


class _Reader:
    """Replies read from a socket through a small buffer; a value's bytes beyond what is
    buffered are received straight into their destination. Every receive waits at most
    until `end` (time.monotonic()): the whole read is bounded, not each piece of it."""

    def __init__(self, sock, end: float, size: int = 1 << 16):
        self.sock, self.end = sock, end
        self.buf = bytearray(size)
        self.mv = memoryview(self.buf)
        self.pos = self.lim = 0

    def _recv(self, into) -> int:
        import redis
        left = self.end - time.monotonic()
        if left <= 0:
            raise redis.TimeoutError("no reply within the deadline")
        try:
            self.sock.settimeout(left)
            got = self.sock.recv_into(into)
        except socket.timeout as e:
            raise redis.TimeoutError("Timeout reading from socket") from e
        except OSError as e:
            raise redis.ConnectionError(f"Error while reading from socket: {e}") from e
        if not got:
            raise redis.ConnectionError("Connection closed by server.")
        return got

    def _fill(self) -> None:
        if self.pos == self.lim:
            self.pos = self.lim = 0
        elif self.lim == len(self.buf):   # a line longer than what is left: move it to the front
            n = self.lim - self.pos
            if n == len(self.buf):
                import redis
                raise redis.ConnectionError("reply line longer than 64 KiB")
            self.buf[:n] = self.buf[self.pos: self.lim]
            self.pos, self.lim = 0, n
        self.lim += self._recv(self.mv[self.lim:])

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.pos, self.lim)
            if i >= 0:
                out = bytes(self.mv[self.pos: i])
                self.pos = i + 2
                return out
            self._fill()

    def read_into(self, dst) -> None:
        """len(dst) bytes into dst (writable bytes-like)."""
        dst = memoryview(dst)   # a slice of a bytearray would be a copy
        n = min(len(dst), self.lim - self.pos)
        dst[:n] = self.mv[self.pos: self.pos + n]
        self.pos += n
        while n < len(dst):
            n += self._recv(dst[n:])

    def skip(self, k: int) -> None:
        while k:
            if self.pos == self.lim:
                self._fill()
            n = min(k, self.lim - self.pos)
            self.pos += n
            k -= n

    @property
    def pending(self) -> int:
        return self.lim - self.pos

    def reply(self):
        """One reply: bytes (simple and bulk strings), int, None (nulls), a list (arrays);
        an error reply raises redis.ResponseError, any other type redis.ConnectionError
        (the call then drops the connection)."""
        import redis
        head = self.line()
        kind, rest = head[:1], head[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise redis.ResponseError(rest.decode(errors="replace"))
        if kind == b"_":
            return None
        try:
            n = int(rest)
        except ValueError:
            raise redis.ConnectionError(f"malformed reply {head[:32]!r}") from None
        if kind == b":":
            return n
        if kind == b"$":
            if n < 0:
                return None
            if n > _MAX_BULK:
                raise redis.ConnectionError(f"a value of {n} bytes announced (Redis sends at most {_MAX_BULK})")
            out = bytearray(n + 2)
            self.read_into(out)
            if out[n:] != b"\r\n":
                raise redis.ConnectionError(f"no CRLF after a value of {n} bytes")
            del out[n:]
            return bytes(out)
        if kind == b"*":
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise redis.ConnectionError(f"unexpected reply {head[:32]!r}")


def _read_mget_into(sock, rows, n: int, end: float) -> list[int]:
    """Reads an MGET reply of n values (RESP2, or RESP3's null) into the rows of `rows`.
    Anything but the reply expected (an error reply, another type, a missing CRLF, bytes
    after it) raises, and the call drops the connection."""
    return _mget_into(_Reader(sock, end), rows, n)


def _mget_into(rd: _Reader, rows, n: int) -> list[int]:
    import redis
    head = rd.line()
    if head[:1] == b"-":
        raise redis.ResponseError(head[1:].decode(errors="replace"))
    if head != b"*%d" % n:
        raise redis.ConnectionError(f"MGET of {n} keys answered {head[:32]!r}")
    width = rows.shape[1]
    flat = memoryview(rows.reshape(-1))
    out = []
    for i in range(n):
        h = rd.line()
        if h in (b"$-1", b"_"):
            out.append(0)
            continue
        if h[:1] != b"$":
            raise redis.ConnectionError(f"MGET value {i}: {h[:32]!r}")
        k = int(h[1:])
        if k > width:
            rd.skip(k + 2)
            out.append(-1)
            continue
        o = i * width
        if rd.lim - rd.pos >= k + 2:   # all of it buffered already (small values): one copy
            flat[o: o + k] = rd.mv[rd.pos: rd.pos + k]
            rd.pos += k
            crlf = rd.mv[rd.pos: rd.pos + 2]
            rd.pos += 2
        else:
            rd.read_into(flat[o: o + k])
            crlf = bytearray(2)
            rd.read_into(crlf)
        if crlf != b"\r\n":
            raise redis.ConnectionError(f"MGET value {i}: no CRLF after {k} bytes")
        out.append(k)
    if rd.pending:
        raise redis.ConnectionError(f"{rd.pending} bytes after the MGET reply")
    return out


class RedisBackend(RemoteBackend):
    scheme = "redis"
    native_ttl = True
    keeps_first = False
    bounds_itself = True
    takes_parts = True
    reads_into = True

    def __init__(self, url: str, socket_timeout_s: float = 2.0):
        super().__init__(url)
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"expected redis://HOST:PORT/DB, got {url!r}")
        self.socket_timeout_s = socket_timeout_s
        self._r = None
        self._idle: list = []         # connections not in use (a call takes one)
        self._lock = threading.Lock()

    def connect(self) -> None:
        try:
            import redis
        except ImportError as e:
            raise RemoteError(f"the redis client is not installed: pip install redis ({e})") from e
        r = redis.Redis.from_url(self.url, socket_timeout=self.socket_timeout_s,
                                 socket_connect_timeout=self.socket_timeout_s)
        conn = r.connection_pool.make_connection()   # the first call's connection, open already
        conn.send_command("PING")
        if conn.read_response() not in (b"PONG", "PONG", True):
            raise RemoteError(f"{self.url}: PING was not answered with PONG")
        self._r = r
        with self._lock:
            self._idle.append(conn)

    @property
    def client(self):
        return self._r

    def _run(self, commands: list[tuple], timeout_s: float | None, read=None) -> list:
        """The commands' replies, sent as one pipeline on one connection. timeout_s given
        (the caller's thread): within timeout_s, on an open connection, else RemoteNotReady
        before anything is sent. None (a worker): within socket_timeout_s, opening a
        connection when none is open. A connection goes back to the idle list only when the
        call read every reply it asked for and nothing more; any error closes it. read(rd):
        reads the replies itself from the _Reader instead of one rd.reply() per command."""
        import redis
        limit = self.socket_timeout_s if timeout_s is None else min(timeout_s, self.socket_timeout_s)
        end = time.monotonic() + limit
        conn = self._take(inline=timeout_s is not None)
        try:
            if getattr(conn, "_sock", None) is None:
                # connect and handshake (a worker's call): redis-py's own timeouts
                conn.connect_check_health(check_health=False)
            sock = conn._sock
            _send(sock, _pack(commands), end)
            rd = _Reader(sock, end)
            out = read(rd) if read is not None else [rd.reply() for _ in commands]
            if rd.pending:
                raise redis.ConnectionError(f"{rd.pending} bytes after the replies")
        except (redis.TimeoutError, socket.timeout) as e:
            conn.disconnect()
            raise RemoteTimeout(f"no reply within {limit * 1e3:.0f} ms ({e})") from e
        except BaseException:
            conn.disconnect()
            raise
        with self._lock:
            self._idle.append(conn)
        return out

    def _take(self, inline: bool):
        """An idle open connection (one the server closed meanwhile, or that has bytes
        waiting, is dropped); else, in a worker, a new unopened one, and RemoteNotReady in
        the caller's thread."""
        import redis
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            try:
                if not conn.can_read(timeout=0):
                    return conn
            except (redis.ConnectionError, OSError):
                pass
            conn.disconnect()       # a stray reply, or a closed peer (a restarted server)
        if inline:
            raise RemoteNotReady("no open connection")
        if self._r is None:
            raise RemoteError(f"{self.url}: not connected")
        return self._r.connection_pool.make_connection()

    def ping(self) -> None:
        (pong,) = self._run([("PING",)], None)
        if pong != b"PONG":
            raise RemoteError(f"{self.url}: PING answered {pong!r}")

    def exists(self, keys: Sequence[str], timeout_s: float | None = None) -> list[bool]:
        if not keys:
            return []
        return [bool(x) for x in self._run([("EXISTS", k) for k in keys], timeout_s)]

    def get(self, keys: Sequence[str], ttl_s: float | None = None, timeout_s: float | None = None) \
            -> list[bytes | None]:
        if not keys:
            return []
        if ttl_s:
            px = max(1, int(ttl_s * 1000))
            vals = self._run([("GETEX", k, "PX", px) for k in keys], timeout_s)
        else:
            (vals,) = self._run([("MGET", *keys)], timeout_s)
        return [v if v else None for v in vals]

    def get_into(self, keys: Sequence[str], rows, timeout_s: float | None = None) -> list[int]:
        """One MGET whose reply is read straight into the rows of `rows` (uint8 [n, row]):
        the values go from the socket to their row with recv_into (at most the part that
        came with a reply header is copied), with no bytes object per value and none of
        redis-py's buffering and copies. Per key: the value's length, 0 when missing, -1
        when it is longer than a row (it is read and dropped)."""
        if not keys:
            return []
        if rows.dtype != np.uint8 or rows.ndim != 2 or len(rows) < len(keys) or not rows.flags.c_contiguous:
            raise ValueError("get_into: rows must be C-contiguous uint8 [n, row]")
        return self._run([("MGET", *keys)], timeout_s, read=lambda rd: _mget_into(rd, rows, len(keys)))

    def put(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None, overwrite: bool = False,
            timeout_s: float | None = None) -> None:
        """Without a TTL one MSET (it replaces an existing value: allowed, and such a value
        is the same block; the tier skips keys that exist before it writes)."""
        if not items:
            return
        if ttl_s:
            px = max(1, int(ttl_s * 1000))
            cmds = [("SET", k, v, "PX", px) if overwrite else ("SET", k, v, "PX", px, "NX") for k, v in items]
        else:
            cmds = [("MSET", *[x for kv in items for x in kv])]
        try:
            self._run(cmds, timeout_s)
        except Exception as e:
            import redis
            if isinstance(e, redis.ResponseError):
                raise RemoteError(f"{cmds[0][0]}: {e}") from e
            raise

    def remove(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        if keys:
            self._run([("DEL", *keys)], timeout_s)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()
        if self._r is not None:
            self._r.close()
            self._r = None
