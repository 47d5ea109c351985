"""The remote tier's one small interface, and the guard every call goes through.

A backend (Mooncake Store, Redis) implements four blocking batch operations on opaque
bytes under string keys. `Guarded` wraps one backend for the cache: no call outlives its
deadline. A backend that bounds its own calls (Redis) runs them in the caller's thread;
any other call runs in a small pool of daemon worker threads and is waited for at most its
deadline (a call that hangs, as a Mooncake client's does when its master is gone, keeps
its worker but not the request, and never holds up the process's exit). A circuit breaker
stops calling a backend that keeps failing; while it is open, one cheap probe call at a
time (in a worker) finds out when the backend is back. A fault of any kind is reported as
RemoteUnavailable, which the tier counts and treats as a miss. How long each of these
takes, measured: docs/remote.md.
"""
from __future__ import annotations

import abc
import concurrent.futures as cf
import threading
import time
from typing import Callable, Sequence

from .breaker import CircuitBreaker
from .metrics import RemoteMetrics
from .workers import DaemonWorkers

__all__ = ["RemoteBackend", "RemoteError", "RemoteFull", "RemoteNotReady", "RemoteTimeout", "RemoteUnavailable",
           "Guarded"]


class RemoteError(RuntimeError):
    """A backend call failed (connection, server error, bad return code)."""


class RemoteTimeout(RemoteError):
    """A backend that bounds its own calls (bounds_itself) ran out of the call's time."""


class RemoteNotReady(RemoteError):
    """A bounds_itself backend has no open connection at hand for a call in the caller's
    thread (opening one could outlast the deadline): Guarded runs the call in a worker."""


class RemoteFull(RemoteError):
    """The backend has no room for a put (not a fault: it does not trip the breaker)."""


class RemoteUnavailable(RuntimeError):
    """A call did not happen or did not finish in time; `cause` says why (for the counter):
    timeout, error, breaker_open, busy, connecting."""

    def __init__(self, cause: str, detail: str = ""):
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


class RemoteBackend(abc.ABC):
    """Batch operations on bytes values. Each may block; Guarded bounds them."""

    scheme = ""
    native_ttl = False     # put/get honour ttl_s (else the tier checks a value's age itself)
    keeps_first = False    # a put of an existing key keeps the old value
    # The backend bounds each call by the time given to it (its operations take timeout_s=,
    # raise RemoteTimeout once it has passed, and RemoteNotReady before doing anything when
    # they would first have to open a connection): Guarded calls it in the caller's thread,
    # without the worker handoff that a client which can hang (Mooncake's) needs. Called
    # without timeout_s (in a worker), an operation may take a connection's own timeouts.
    bounds_itself = False
    # put() accepts a value as a tuple of bytes-like parts, stored as their concatenation
    # (the tier then hands it the payload without copying it into the record).
    takes_parts = False
    # get_into() reads values straight into the rows of one array (no bytes object per
    # value); the tier then checks them where they landed and serves views of them.
    reads_into = False

    def __init__(self, url: str):
        self.url = url

    def connect(self) -> None:
        """Opens the connection (called once, in a worker, before the first operation)."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abc.abstractmethod
    def get(self, keys: Sequence[str], ttl_s: float | None = None) -> list[bytes | None]:
        """Values (None when missing); ttl_s: restart each found key's TTL (sliding)."""

    def get_into(self, keys: Sequence[str], rows) -> list[int]:
        """(reads_into backends) Values into the rows of `rows` (uint8 [n, row], C-contiguous).
        Per key: the value's length, 0 when missing, -1 when it is longer than a row."""
        raise NotImplementedError

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None, overwrite: bool = False) -> None:
        """Stores values; overwrite=False may leave an existing value in place. A value is
        bytes-like, or a tuple of parts where takes_parts is set."""

    def put_records(self, keys: Sequence[str], batch, overwrite: bool = False, **kw) -> None:
        """Stores the values of a record.RecordBatch, value i under keys[i]. By default they
        are encoded into one fresh buffer (as parts where takes_parts is set) and put();
        a backend with a faster way to send them (Mooncake: from a registered buffer)
        encodes them there instead, in the call."""
        self.put(list(zip(keys, batch.values(self.takes_parts))), overwrite=overwrite, **kw)

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> None: ...

    def ping(self) -> None:
        """One cheap call that succeeds only when the backend answers (the breaker's probe)."""
        self.exists(["dsv41:probe"])

    def close(self) -> None:
        pass


class Guarded:
    """A backend behind deadlines, a circuit breaker and metrics."""

    def __init__(self, backend: RemoteBackend, metrics: RemoteMetrics, *, workers: int = 4,
                 breaker_failures: int = 3, breaker_cooldown_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic):
        self.backend, self.metrics = backend, metrics
        self.name = backend.scheme
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s, clock,
                                      on_change=lambda s: metrics.breaker_state.set(s, backend=self.name))
        metrics.breaker_state.set(0, backend=self.name)
        # Calls run on one primary worker while it is free, and on the others only while it
        # is busy (a hung call): the same warm thread every time is faster than whichever
        # pooled thread wakes (docs/remote.md). Probes and connects run on the others.
        self._primary = DaemonWorkers(1, f"dsv41-remote-{self.name}-0")
        self._primary_busy = False
        self._pool = DaemonWorkers(max(1, workers - 1), f"dsv41-remote-{self.name}")
        self._busy = 0          # calls and probes running in a worker (connects excluded)
        self._workers = workers
        self._probing = False
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._connecting: cf.Future | None = None
        self._start_connect()

    def _start_connect(self) -> None:
        """Starts a connect in a worker unless one is running; while the breaker is open,
        only when a probe is due (the connect is the probe)."""
        with self._lock:
            if self._connected.is_set() or (self._connecting is not None and not self._connecting.done()):
                return
            if not self.breaker.allow() and not self.breaker.begin_probe():
                return
            try:
                self._connecting = self._pool.submit(self._connect)
            except RuntimeError:   # closed
                pass

    def _connect(self) -> None:
        try:
            self.backend.connect()
            self._connected.set()
            self.breaker.success()
        except Exception:
            self.breaker.failure()
            self.metrics.errors.inc(backend=self.name, cause="connect")

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s)

    def call(self, op: str, timeout_s: float, *args, **kwargs):
        """backend.<op>(*args) within timeout_s, or RemoteUnavailable."""
        m = self.metrics
        if not self._connected.is_set():
            self._start_connect()
            m.errors.inc(backend=self.name, cause="connecting")
            raise RemoteUnavailable("connecting", self.backend.url)
        if not self.breaker.allow():
            self._probe_if_due()
            m.errors.inc(backend=self.name, cause="breaker_open")
            raise RemoteUnavailable("breaker_open", self.backend.url)
        t0 = time.perf_counter()
        try:
            if self.backend.bounds_itself:
                try:
                    out = getattr(self.backend, op)(*args, timeout_s=timeout_s, **kwargs)
                except RemoteNotReady:   # no open connection: it is opened in a worker
                    out = self._in_worker(op, timeout_s - (time.perf_counter() - t0), args, kwargs)
            else:
                out = self._in_worker(op, timeout_s, args, kwargs)
        except RemoteFull:
            self.breaker.success()
            raise
        except RemoteUnavailable:
            raise
        except Exception as e:
            self.breaker.failure()
            cause = "timeout" if isinstance(e, RemoteTimeout) else "error"
            m.errors.inc(backend=self.name, cause=cause)
            raise RemoteUnavailable(cause, f"{op}: {e}") from e
        finally:
            m.seconds.observe(time.perf_counter() - t0, backend=self.name, op=op)
        self.breaker.success()
        return out

    def _in_worker(self, op: str, timeout_s: float, args, kwargs):
        """backend.<op>(*args) in a worker thread, waited for at most timeout_s: a call that
        hangs keeps its worker, not the caller."""
        m = self.metrics
        with self._lock:
            if self._busy >= self._workers:  # every worker is stuck in a hung call
                busy = True
            else:
                busy = False
                self._busy += 1
                primary = not self._primary_busy
                self._primary_busy = True  # by this call, or still by the one it overflows
        if busy:
            self.breaker.failure()
            m.errors.inc(backend=self.name, cause="busy")
            raise RemoteUnavailable("busy", "every worker is waiting on the backend")
        fut = (self._primary if primary else self._pool).submit(self._run, op, args, kwargs, primary)
        try:
            return fut.result(timeout=max(0.0, timeout_s))
        except cf.TimeoutError:
            self.breaker.failure()
            m.errors.inc(backend=self.name, cause="timeout")
            raise RemoteUnavailable("timeout", f"{op} took over {timeout_s * 1e3:.0f} ms") from None

    def _run(self, op, args, kwargs, primary: bool = False):
        try:
            return getattr(self.backend, op)(*args, **kwargs)
        finally:
            with self._lock:
                self._busy -= 1
                if primary:
                    self._primary_busy = False

    def _probe_if_due(self) -> None:
        """Starts one probe (backend.ping()) in a worker when the open breaker is due for
        one. Requests do not wait for it."""
        with self._lock:
            if self._probing or self._busy >= self._workers or not self.breaker.begin_probe():
                return
            self._probing = True
            self._busy += 1
        try:
            self._pool.submit(self._probe)
        except RuntimeError:   # closed meanwhile
            with self._lock:
                self._probing = False
                self._busy -= 1

    def _probe(self) -> None:
        try:
            self.backend.ping()
        except Exception:
            self.breaker.failure()
            self.metrics.errors.inc(backend=self.name, cause="probe")
        else:
            self.breaker.success()
        finally:
            with self._lock:
                self._probing = False
                self._busy -= 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Closes the backend, waiting at most timeout_s. A client must not be closed under
        a call still running in a worker (Mooncake's segfaults): when calls hang past the
        wait, the client is left to be freed with the last reference to it instead. The
        workers are daemon threads: one stuck in a call does not hold up the exit."""
        self._primary.shutdown()
        self._pool.shutdown()
        end = time.monotonic() + timeout_s
        while self._busy and time.monotonic() < end:
            time.sleep(0.01)
        with self._lock:
            if self._busy:
                return

        def _close():
            try:
                self.backend.close()
            except Exception:  # closing a broken client: nothing left to do
                pass
        # A client whose server is gone can hang in close too.
        t = threading.Thread(target=_close, name=f"dsv41-remote-close-{self.name}", daemon=True)
        t.start()
        t.join(max(0.0, end - time.monotonic()) + 0.5)
