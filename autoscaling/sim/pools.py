"""A simulated pool: replicas starting, serving and draining, and the scale-to-target step."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Generic, TypeVar

from autoscaling.history import ScalingHistory
from autoscaling.sim.profiles import ServiceProfile
from autoscaling.sim.replicas import DecodeReplica, PrefillReplica, Replica

R = TypeVar("R", PrefillReplica, DecodeReplica)


class SimPool(Generic[R]):
    def __init__(
        self, make: Callable[[int, ServiceProfile, float], R], profile: ServiceProfile
    ) -> None:
        self._make: Callable[[int, ServiceProfile, float], R] = make
        self.profile = profile
        self.replicas: list[R] = []  # every replica ever launched, for cost
        self.serving: list[R] = []  # ready and taking new work
        self.starting: list[R] = []
        self.history = ScalingHistory()
        self.peak = 0

    @property
    def num_target(self) -> int:
        return len(self.serving) + len(self.starting)

    def launch(self, now_s: float, *, ready_now: bool = False) -> R:
        replica = self._make(len(self.replicas), self.profile, now_s)
        if ready_now:
            replica.ready_s = now_s
            self.serving.append(replica)
        else:
            self.starting.append(replica)
        self.replicas.append(replica)
        self.peak = max(self.peak, self.num_target)
        return replica

    def mark_ready(self, replica: R) -> bool:
        """A started replica begins serving, unless it was cancelled while starting."""
        if replica not in self.starting:
            return False
        self.starting.remove(replica)
        self.serving.append(replica)
        return True

    def scale_to(self, target: int, now_s: float, load: Callable[[R], float]) -> list[R]:
        """Launch or retire replicas to reach `target`; the launched ones (to schedule ready)."""
        launched = [self.launch(now_s) for _ in range(target - self.num_target)]
        while self.num_target > target and self.starting:
            # Cancel the youngest start first: it has the longest still to go.
            self.starting.pop().stopped_s = now_s
        while self.num_target > target:
            victim = min(self.serving, key=load)
            self.serving.remove(victim)
            victim.is_draining = True
            stop_if_drained(victim, now_s)
        return launched

    def pick_two(self, rng: random.Random, load: Callable[[R], float]) -> list[R]:
        """Power of two choices, as Ray Serve's router does: two serving replicas, less
        loaded first."""
        if len(self.serving) <= 1:
            return list(self.serving)
        return sorted(rng.sample(self.serving, 2), key=load)

    def replica_seconds(self, end_s: float) -> float:
        return sum(
            (r.stopped_s if r.stopped_s is not None else end_s) - r.launched_s
            for r in self.replicas
        )


def stop_if_drained(replica: Replica, now_s: float) -> None:
    if replica.is_draining and replica.stopped_s is None and _is_idle(replica):
        replica.stopped_s = now_s


def _is_idle(replica: Replica) -> bool:
    assert isinstance(replica, PrefillReplica | DecodeReplica)
    return replica.is_idle
