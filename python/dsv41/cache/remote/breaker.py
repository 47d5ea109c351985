"""A circuit breaker per remote backend: after `failures` consecutive faults it opens and
requests fail at once (a miss, no waiting). While it is open, one probe at a time may go
out, the first `cooldown_s` after it opened and then `cooldown_s` after each failed probe
(half-open while the probe runs; requests are still refused then): a probe's success
closes it, its failure opens it again. The owner sends the probes (Guarded: one cheap call
in a worker thread), so no request pays for finding out that a backend is back."""
from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["CircuitBreaker", "CLOSED", "OPEN", "HALF_OPEN"]

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # also the values of the breaker-state gauge


class CircuitBreaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int], None] = lambda state: None):
        if failures < 1 or not cooldown_s > 0:
            raise ValueError("breaker: failures must be >= 1 and cooldown_s > 0")
        self.failures, self.cooldown_s, self.clock, self.on_change = failures, cooldown_s, clock, on_change
        self._lock = threading.Lock()
        self._state = CLOSED
        self._count = 0
        self._opened_at = 0.0

    @property
    def state(self) -> int:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether a request may go out now (only while closed)."""
        with self._lock:
            return self._state == CLOSED

    def begin_probe(self) -> bool:
        """Whether the owner should send a probe now: open for at least cooldown_s since it
        opened or the last probe failed. True moves it to half-open until success() or
        failure() reports the probe's outcome."""
        with self._lock:
            if self._state != OPEN or self.clock() - self._opened_at < self.cooldown_s:
                return False
            self._set(HALF_OPEN)
            return True

    def success(self) -> None:
        with self._lock:
            self._count = 0
            if self._state != CLOSED:
                self._set(CLOSED)

    def failure(self) -> None:
        with self._lock:
            self._count += 1
            if self._state == HALF_OPEN or self._count >= self.failures:
                self._opened_at = self.clock()
                if self._state != OPEN:
                    self._set(OPEN)

    def _set(self, state: int) -> None:
        self._state = state
        self.on_change(state)
