"""A circuit breaker per remote backend: after `failures` consecutive faults it opens and
calls fail at once (a miss, no waiting) for `cooldown_s`; then one probe call is let
through (half-open): success closes it, failure opens it for another cooldown."""
from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["CircuitBreaker", "CLOSED", "OPEN", "HALF_OPEN"]

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # also the values of the breaker-state gauge


class CircuitBreaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int], None] = lambda state: None):
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("breaker: failures must be >= 1 and cooldown_s > 0")
        self.failures, self.cooldown_s, self.clock, self.on_change = failures, cooldown_s, clock, on_change
        self._lock = threading.Lock()
        self._state = CLOSED
        self._count = 0
        self._opened_at = 0.0
        self._probing = False

    @property
    def state(self) -> int:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether a call may go out now (in half-open state: only the one probe)."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and self.clock() - self._opened_at >= self.cooldown_s:
                self._set(HALF_OPEN)
            if self._state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._count = 0
            self._probing = False
            if self._state != CLOSED:
                self._set(CLOSED)

    def failure(self) -> None:
        with self._lock:
            self._count += 1
            self._probing = False
            if self._state == HALF_OPEN or self._count >= self.failures:
                self._opened_at = self.clock()
                if self._state != OPEN:
                    self._set(OPEN)

    def _set(self, state: int) -> None:
        self._state = state
        self.on_change(state)
