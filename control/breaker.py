"""A circuit breaker for advisory calls, such as the prefix index in Redis: after `threshold`
failures in a row the calls are skipped for `open_s`; then one trial call is let through, and
its outcome closes the breaker or opens it again. Pure: the clock is injected. `BestEffort`
puts an advisory write behind one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable


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


class BestEffort:
    """Advisory writes to a store that may be down (latency samples, replica status): each is
    bounded to `timeout_s`, skipped while the breaker is open, never raised to the caller, and
    logged once when they start failing and once when they work again, not once per write."""

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        timeout_s: float,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._what = what
        self._logger = logger
        self._timeout_s = timeout_s
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._failing = False

    async def run(self, write: Callable[[], Awaitable[object]]) -> bool:
        """Whether the write was made and succeeded."""
        if not self.breaker.allow():
            return False
        try:
            await asyncio.wait_for(write(), self._timeout_s)
        except Exception as exc:
            self.breaker.failed()
            if not self._failing:
                self._failing = True
                self._logger.warning(
                    "%s failing (%s: %s); skipped until a trial write succeeds",
                    self._what,
                    type(exc).__name__,
                    exc,
                )
            return False
        self.breaker.succeeded()
        if self._failing:
            self._failing = False
            self._logger.warning("%s working again", self._what)
        return True
