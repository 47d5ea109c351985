"""BackgroundCommitter: the thread that takes SSD writes off the request path."""
from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Callable

from ..store import PersistentStore

__all__ = ["BackgroundCommitter"]

log = logging.getLogger("dsv41.cache")


class BackgroundCommitter:
    """One thread that commits what requests queued in the store, so SSD writes leave the
    request path. kick() after queueing; commits are serialized by the store's write lock,
    so flush() (a commit from the caller's thread) waits for one in flight. Before each
    commit it runs `before_commit` (the SSD tier's queued persist jobs: adopted pages it
    reads from the pool and queues as records)."""

    def __init__(self, store: PersistentStore, before_commit: Callable[[], None] = lambda: None):
        self.store = store
        self.before_commit = before_commit
        self._wake = threading.Event()
        self._stopping = False
        self._last = None  # the ticket of the last commit this thread started
        self._thread = threading.Thread(target=self._run, name="dsv41-cache-commit", daemon=True)
        self._thread.start()
        # At interpreter exit a cache nobody closed stops its thread and commits what is
        # queued (a normal exit loses no queued write); a weak reference keeps it collectable.
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c.stop(flush=True))

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return  # the store's close() commits what is left
            try:
                self.before_commit()
                # Sealing (fsync, rename) goes on in the store's sealer thread while this
                # thread waits for the next batch; flush() waits for it. Waiting for the
                # previous ticket only after starting the next keeps that overlap.
                ticket = self.store.commit_async()
                last, self._last = self._last, ticket
                if last is not None:
                    last.result()  # I/O errors degrade the tier inside; this is for bugs
            except Exception:  # noqa: BLE001 - a background thread must not die silently
                log.exception("background commit of the SSD tier failed")

    def stop(self, flush: bool = False) -> None:
        """Stops the thread; flush=True then runs the queued jobs and commits what is
        still queued."""
        self._stopping = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        store = self.store
        if flush and not store.closed and store.writable:
            try:
                self.before_commit()
                if store.pending_bytes:
                    store.commit()
            except Exception:  # noqa: BLE001 - at exit: say so, do not mask the exit status
                log.exception("committing the SSD tier's queued writes at exit failed")
