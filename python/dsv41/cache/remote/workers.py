"""Worker threads for remote calls that may hang: daemon threads, so that a process whose
backend is stuck (a Mooncake client waits on a stopped master for its whole RPC timeout,
docs/remote.md) still exits at once.

concurrent.futures.ThreadPoolExecutor is not usable here: its threads are not daemon
threads and the interpreter joins every one of them at exit, so one call stuck in a client
held the exit of a process whose cache was closed long before. These threads are not
joined; a call still running when the process exits is abandoned with it.
"""
from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from typing import Callable

__all__ = ["DaemonWorkers"]


class DaemonWorkers:
    """Up to `n` daemon threads running submitted calls in order of submission. A thread
    is started when a call finds none idle (so a pool of one always runs on the same warm
    thread); submit() returns a concurrent.futures.Future."""

    def __init__(self, n: int, name: str):
        if n < 1:
            raise ValueError(f"DaemonWorkers: n must be >= 1, got {n}")
        self._n, self._name = n, name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shut = False

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: submit after shutdown")
            self._q.put((fut, fn, args))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._n:
                t = threading.Thread(target=self._loop, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return fut

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.put(None)   # the next thread stops too
                return
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits on the future
                    fut.set_exception(e)
            del item, fut, fn, args
            self._idle.release()

    def shutdown(self) -> None:
        """Cancels the calls not started; threads end once their current call returns."""
        with self._lock:
            self._shut = True
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
            self._q.put(None)
