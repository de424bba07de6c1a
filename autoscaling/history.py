"""The little a policy remembers between ticks: recent scale events and how long a condition held.

Immutable: each decision returns a new `ScalingHistory`, which the caller stores (the Ray
policy's state dict, the simulator's pool) and passes back on the next tick.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple


class ScaleEvent(NamedTuple):
    """One change of a pool's target replicas."""

    at_s: float
    from_replicas: int
    to_replicas: int
    reason: str

    @property
    def is_upscale(self) -> bool:
        return self.to_replicas > self.from_replicas


def held_since(since_s: float | None, holds: bool, now_s: float) -> float | None:
    """When a condition that `holds` now started holding (None once it stops)."""
    if not holds:
        return None
    return now_s if since_s is None else since_s


@dataclass(frozen=True)
class ScalingHistory:
    """Scale events and condition timers of one pool.

    `breach_since_s`: since when the pool has wanted more replicas (None: it does not now).
    `calm_since_s`: since when every down-scale margin has held.
    `waiting_since_s`: since when decode has had waiting sequences.
    """

    last_upscale_at_s: float | None = None
    last_downscale_at_s: float | None = None
    breach_since_s: float | None = None
    calm_since_s: float | None = None
    waiting_since_s: float | None = None
    events: tuple[ScaleEvent, ...] = ()

    @property
    def last_event_at_s(self) -> float | None:
        times = [t for t in (self.last_upscale_at_s, self.last_downscale_at_s) if t is not None]
        return max(times) if times else None

    def seconds_since_upscale(self, now_s: float) -> float:
        return float("inf") if self.last_upscale_at_s is None else now_s - self.last_upscale_at_s

    def seconds_since_event(self, now_s: float) -> float:
        last = self.last_event_at_s
        return float("inf") if last is None else now_s - last

    def with_timers(
        self, now_s: float, *, breach: bool, calm: bool, waiting: bool = False
    ) -> ScalingHistory:
        return replace(
            self,
            breach_since_s=held_since(self.breach_since_s, breach, now_s),
            calm_since_s=held_since(self.calm_since_s, calm, now_s),
            waiting_since_s=held_since(self.waiting_since_s, waiting, now_s),
        )

    def with_event(self, event: ScaleEvent, keep: int) -> ScalingHistory:
        """Record a scale event. The breach timer restarts; calm keeps running across a
        scale-down (calm is judged for one replica fewer each time) and restarts after a
        scale-up."""
        return replace(
            self,
            last_upscale_at_s=event.at_s if event.is_upscale else self.last_upscale_at_s,
            last_downscale_at_s=self.last_downscale_at_s if event.is_upscale else event.at_s,
            breach_since_s=None,
            calm_since_s=None if event.is_upscale else self.calm_since_s,
            events=(*self.events, event)[-keep:],
        )
