"""A circuit breaker for advisory calls, such as the prefix index in Redis: after `threshold`
failures in a row the calls are skipped for `open_s`; then one trial call is let through, and
its outcome closes the breaker or opens it again. Pure: the clock is injected."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        threshold: int = 3,
        open_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        if open_s <= 0:
            raise ValueError(f"open_s must be > 0, got {open_s}")
        self._threshold = threshold
        self._open_s = open_s
        self._clock = clock
        self._failures = 0
        self._open_until: float | None = None  # None: closed
        self._trial_out = False

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether to make the call now (and then report it with `succeeded` / `failed`)."""
        if self._open_until is None:
            return True
        if self._trial_out or self._clock() < self._open_until:
            return False
        self._trial_out = True  # half-open: this call is the trial
        return True

    def succeeded(self) -> None:
        self._failures = 0
        self._open_until = None
        self._trial_out = False

    def failed(self) -> None:
        self._failures += 1
        self._trial_out = False
        if self._open_until is not None or self._failures >= self._threshold:
            self._open_until = self._clock() + self._open_s
