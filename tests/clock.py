"""A clock for code that takes one injected (`clock: Callable[[], float]`): it reads `now`
seconds until the test moves it."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
