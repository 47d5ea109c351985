"""SerialWorker: one thread that runs a store's sealing steps (fdatasync, rename, index) in
the order they were submitted, so commits become durable and visible in commit order."""
from __future__ import annotations

import queue
import sys
import threading

__all__ = ["SerialWorker", "Job"]


class SerialWorker:
    """One daemon thread that runs submitted steps in order (a store's sealer). Not
    concurrent.futures: that refuses new work once interpreter shutdown has begun, and a
    cache commits its queued writes at exit. A thread that is gone (a forked child
    inherits none) is started again."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread if it is not running (a writable store does at open, so its
        first commit does not wait for a thread to start)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, fn, *args) -> "Job":
        job = Job()
        if sys.is_finalizing():
            # No thread runs again (nor starts) once the interpreter finalizes: the step
            # runs here, rather than waiting for a thread that never takes it.
            self._run_one(job, fn, args)
            return job
        self.start()  # after a fork the child has none
        self._q.put((job, fn, args))
        return job

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._run_one(*item)

    @staticmethod
    def _run_one(job: "Job", fn, args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to result()
            job.error = e
        job.done.set()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        self._thread = None


class Job:
    """A step submitted to a SerialWorker: result() waits for it and raises its error."""

    __slots__ = ("done", "error")

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None

    def result(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error
