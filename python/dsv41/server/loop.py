"""EngineLoop: the one thread that runs the engine; HTTP handlers only enqueue and stream.

    loop = EngineLoop(engine, metrics, max_pending=256); loop.start()
    sub = loop.submit([(ids, SamplingParams(...))], namespace="tenant-a")   # on the event loop
    rid, item = await sub.queue.get()      # a StreamEvent per token, or an exception
    loop.abort(sub.request_ids)            # client gone: the engine drops them between steps
    loop.abort([rid], reason="stop")       # a stop string ended it (counted as a stop)
    n = await loop.call(lambda engine: ...)    # inspect the engine between steps
    loop.drain(); loop.stop(); loop.close()    # shutdown: refuse new, fail in-flight, join

Continuous batching: between two steps the thread takes every new request and every abort
from its inbox, so requests join and leave the running batch at step boundaries. Only this
thread touches the engine (and through it the cache), so the engine needs no locks.

Bounded: at most max_pending engine requests (choices) are accepted and unfinished at a
time; submit raises Overloaded beyond that (the server answers 503), so a burst can never
grow memory without bound.

Shutdown: drain() refuses new requests (ShuttingDown, a 503) while those in flight go on;
stop() ends the thread after its current step and fails what is left with ShuttingDown;
close() is stop() and a join. The engine's gauges (running, waiting) are refreshed after
every step and after every batch of aborts, so an aborted last request leaves them at 0.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine import Engine, SamplingParams, StreamEvent
from .metrics import ServerMetrics

__all__ = ["EngineLoop", "Submission", "Overloaded", "EngineFailed", "ShuttingDown"]

log = logging.getLogger("dsv41.server")


class Overloaded(Exception):
    """The bounded queue is full."""


class EngineFailed(RuntimeError):
    """The engine raised while running this request (or the loop shut down under it)."""


class ShuttingDown(EngineFailed):
    """The server is draining or stopping: a new request is refused, and one still in
    flight when the drain ran out is failed with this."""


@dataclass
class Submission:
    """One HTTP request's engine requests. `queue` receives (request_id, StreamEvent) per
    token and (request_id, exception) when the engine fails it; it is unbounded, but holds
    at most max_tokens events per request."""

    request_ids: list[str]
    queue: asyncio.Queue
    aio: asyncio.AbstractEventLoop = field(repr=False)

    def deliver(self, rid: str, item) -> None:
        try:
            self.aio.call_soon_threadsafe(self.queue.put_nowait, (rid, item))
        except RuntimeError:        # the event loop is closed: nobody is listening
            pass


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, *, max_pending: int = 256):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.max_pending = max_pending
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()           # pending count and ids, across threads
        self._pending = 0
        self._ids = itertools.count()
        self._routes: dict[str, Submission] = {}   # loop thread only
        self._closing = False
        self._draining = False
        self._preemptions = 0                   # the engine's counter, as last read
        self._thread: threading.Thread | None = None

    # ---- any thread ---------------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="dsv41-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The thread runs and accepts requests (False once draining)."""
        return self._thread is not None and self._thread.is_alive() and not (self._closing or self._draining)

    @property
    def running(self) -> bool:
        """The thread runs and takes work (draining or not)."""
        return self._thread is not None and self._thread.is_alive() and not self._closing

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Refuses new requests from now on; those in flight go on."""
        self._draining = True

    def stop(self) -> None:
        """Ends the thread after its current step, without waiting; unfinished requests are
        aborted and their clients get ShuttingDown."""
        self._draining = self._closing = True
        self._wake.set()

    def close(self, timeout: float = 30.0) -> None:
        """stop(), then waits for the thread."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the event loop's side ----------------------------------------------------------

    def submit(self, requests: list[tuple[list[int], SamplingParams]], namespace: str = "",
               prefix: str = "req") -> Submission:
        """Enqueues engine requests (all or none); raises Overloaded when they do not fit,
        ShuttingDown once draining."""
        with self._lock:
            if self._draining:
                raise ShuttingDown("the server is shutting down")
            if self._pending + len(requests) > self.max_pending:
                self.metrics.rejected.inc()
                raise Overloaded(f"{self._pending} requests in flight (limit {self.max_pending})")
            self._pending += len(requests)
            rids = [f"{prefix}-{next(self._ids)}" for _ in requests]
        self.metrics.pending.inc(len(requests))
        sub = Submission(rids, asyncio.Queue(), asyncio.get_running_loop())
        for rid, (ids, sp) in zip(rids, requests):
            self._inbox.append(("add", rid, ids, sp, namespace, sub))
        self._wake.set()
        return sub

    def abort(self, request_ids, reason: str = "abort") -> None:
        """Cancels requests (unknown or finished ids are ignored); `reason` is how the
        metrics count their end: "abort" (the client went away) or "stop" (a stop string
        the server found in the text ended it)."""
        for rid in request_ids:
            self._inbox.append(("abort", rid, reason))
        self._wake.set()

    def call(self, fn) -> "asyncio.Future":
        """Runs fn(engine) on the loop thread between steps; awaitable from the event loop
        (use call_sync from other threads)."""
        return asyncio.wrap_future(self.call_sync(fn))

    def call_sync(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append(("call", fn, fut))
        self._wake.set()
        return fut

    # ---- the loop thread ----------------------------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        while True:
            self._wake.clear()
            if self._drain():
                self._update_gauges()
            if self._closing:
                break
            if not eng.has_unfinished():
                self._wake.wait()
                continue
            t0 = time.perf_counter()
            try:
                eng.step()
            except Exception as e:   # noqa: BLE001 - the server must outlive one bad step
                log.exception("engine step failed; failing its requests")
                self.metrics.errors.inc()
                self._fail_all(EngineFailed(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            m = self.metrics
            m.steps.inc()
            m.step_seconds.observe(time.perf_counter() - t0)
            for ev in eng.events:
                self._dispatch(ev)
            self._update_gauges()
        self._drain()
        self._fail_all(ShuttingDown("the server is shutting down"))

    def _update_gauges(self) -> None:
        counts = self.engine.request_counts()
        self.metrics.running.set(counts["running"])
        self.metrics.waiting.set(counts["waiting"])
        preempted = self.engine.counters.get("preemptions", 0)
        if preempted > self._preemptions:
            self.metrics.preemptions.inc(preempted - self._preemptions)
        self._preemptions = preempted

    def _drain(self) -> bool:
        """Runs the inbox; True when it changed the engine's requests."""
        changed = False
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                _, rid, ids, sp, namespace, sub = cmd
                try:
                    self.engine.add_request(ids, sp, namespace=namespace, request_id=rid)
                except Exception as e:   # noqa: BLE001 - handed to the request's client
                    self._done(1)
                    sub.deliver(rid, e)
                    continue
                self._routes[rid] = sub
                changed = True
            elif cmd[0] == "abort":
                _, rid, reason = cmd
                out = self.engine.abort(rid)
                if out is not None:
                    self._routes.pop(rid, None)
                    self._finished(out, reason)
                    changed = True
            else:
                _, fn, fut = cmd
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:   # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
        return changed

    def _dispatch(self, ev: StreamEvent) -> None:
        m = self.metrics
        m.generation_tokens.inc()
        if ev.stats is not None:            # first token: the prefill's facts
            st = ev.stats
            m.ttft.observe(st.ttft_s)
            m.queue_time.observe(st.queue_s)
            m.prefill_time.observe(st.prefill_s)
            m.paths.inc(path=st.path)
            m.prompt_tokens.inc(st.prompt_tokens)
            m.cached_tokens.inc(st.prompt_tokens - st.prefill_tokens)
            m.prefill_tokens.inc(st.prefill_tokens)
            m.replayed_tokens.inc(st.replayed_tokens)
            for tier, n in (("gpu", st.gpu_hit_tokens), ("ssd", st.ssd_hit_tokens), ("swa", st.swa_hit_tokens)):
                m.hit_tokens.inc(n, tier=tier)
        sub = self._routes.get(ev.request_id)
        if ev.finished:
            self._routes.pop(ev.request_id, None)
            self._finished(ev.output, ev.output.finish_reason or "")
        if sub is not None:
            sub.deliver(ev.request_id, ev)

    def _finished(self, out, reason: str) -> None:
        """A request left the engine: its latencies, and for a completed one ("stop",
        "length") its end-to-end and decode time (first to last token)."""
        m, st = self.metrics, out.stats
        for dt in st.token_latencies_s:
            m.token_latency.observe(dt)
        if reason in ("stop", "length") and out.output_tokens:
            decode = sum(st.token_latencies_s)
            m.e2e.observe(st.ttft_s + decode)
            m.decode_time.observe(decode)
        m.finished.inc(reason=reason)
        self._done(1)

    def _fail_all(self, error: Exception) -> None:
        reason = "abort" if isinstance(error, ShuttingDown) else "error"
        for rid, sub in list(self._routes.items()):
            self.engine.abort(rid)
            self.metrics.finished.inc(reason=reason)
            self._done(1)
            sub.deliver(rid, error)
        self._routes.clear()
        self._update_gauges()

    def _done(self, n: int) -> None:
        with self._lock:
            self._pending -= n
        self.metrics.pending.inc(-n)
