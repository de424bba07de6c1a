"""Simulated prefill and decode replicas: the mutable inside of the simulator.

A decode replica is not stepped token by token (thousands of replicas for hours would be
billions of steps). Between two changes of its batch every running sequence gains one token
per step, and step k of the epoch takes A + beta * k, with

    A    = c + d * B + e * (context at the epoch start)      B = running sequences
    beta = e * B                                              (context grows B tokens/step)

so the time of k steps is k * A + beta * k * (k - 1) / 2, and the step at which a sequence
finishes is known when it joins. Only joins and finishes are events.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import NamedTuple

from autoscaling.signals import DecodeReplicaReport, PrefillReplicaReport
from autoscaling.sim.profiles import ServiceProfile


class SimRequest:
    __slots__ = (
        "arrival_s",
        "finish_s",
        "first_token_s",
        "output_tokens",
        "prefill_start_s",
        "prompt_tokens",
        "request_id",
    )

    def __init__(self, request_id: int, arrival_s: float, prompt: int, output: int) -> None:
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt
        self.output_tokens = output
        self.prefill_start_s = math.nan
        self.first_token_s = math.nan
        self.finish_s = math.nan

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class _Batch(NamedTuple):
    end_s: float
    num_tokens: int
    duration_s: float


class Replica:
    """Lifetime bookkeeping shared by both kinds: launch, ready, drain, stop."""

    def __init__(self, replica_id: int, profile: ServiceProfile, launched_s: float) -> None:
        self.replica_id = replica_id
        self.profile = profile
        self.launched_s = launched_s
        self.ready_s = launched_s + profile.startup_s
        self.stopped_s: float | None = None
        self.is_draining = False
        self.version = 0  # bumps when a scheduled event of this replica is superseded
        self.samples: deque[tuple[float, float, float]] = deque()

    def prune(self, now_s: float, window_s: float) -> None:
        while self.samples and self.samples[0][0] <= now_s - window_s:
            self.samples.popleft()


class PrefillReplica(Replica):
    """Pulls batches from the pool's queue whenever it is idle (the router holds the rest)."""

    def __init__(self, replica_id: int, profile: ServiceProfile, launched_s: float) -> None:
        super().__init__(replica_id, profile, launched_s)
        self.batch: list[SimRequest] = []
        self.batch_start_s = self.batch_end_s = 0.0
        self.num_pending_tokens = 0  # prompt tokens of the running batch
        self.batches: deque[_Batch] = deque()
        self.last_speed = 0.0

    @property
    def is_idle(self) -> bool:
        return not self.batch

    def start_batch(self, queue: deque[SimRequest], now_s: float) -> float:
        """Take queued requests up to the token budget (at least one); the batch's end time."""
        assert not self.batch and queue
        budget = self.profile.prefill_max_batch_tokens
        tokens = tokens_sq = 0
        while queue and (not self.batch or tokens + queue[0].prompt_tokens <= budget):
            request = queue.popleft()
            request.prefill_start_s = now_s
            tokens += request.prompt_tokens
            tokens_sq += request.prompt_tokens**2
            self.batch.append(request)
        self.batch_start_s = now_s
        self.batch_end_s = now_s + self.profile.prefill_batch_s(tokens, tokens_sq)
        self.num_pending_tokens = tokens
        return self.batch_end_s

    def finish_batch(self, now_s: float) -> list[SimRequest]:
        done, self.batch = self.batch, []
        self.batches.append(_Batch(now_s, self.num_pending_tokens, now_s - self.batch_start_s))
        self.num_pending_tokens = 0
        for request in done:
            request.first_token_s = now_s
            self.samples.append(
                (now_s, now_s - request.arrival_s, request.prefill_start_s - request.arrival_s)
            )
        return done

    def report(self, now_s: float, window_s: float) -> PrefillReplicaReport:
        self.prune(now_s, window_s)
        while self.batches and self.batches[0].end_s <= now_s - window_s:
            self.batches.popleft()
        busy_s = sum(b.duration_s for b in self.batches)
        if busy_s > 0:
            self.last_speed = sum(b.num_tokens for b in self.batches) / busy_s
        if self.batch:
            busy_s += now_s - self.batch_start_s
        span_s = min(window_s, now_s - self.ready_s)
        remaining = 0
        if self.batch:
            # vLLM knows how many prompt tokens of its running prefills are still to compute.
            done = (now_s - self.batch_start_s) / (self.batch_end_s - self.batch_start_s)
            remaining = round(self.num_pending_tokens * max(0.0, 1.0 - done))
        return PrefillReplicaReport(
            ttft_s=tuple(s[1] for s in self.samples),
            queue_wait_s=tuple(s[2] for s in self.samples),
            num_pending_tokens=remaining,
            num_ongoing_requests=len(self.batch),
            prefill_tokens_per_s=self.last_speed,
            busy_fraction=min(busy_s / span_s, 1.0) if span_s > 0 else 0.0,
        )


class DecodeReplica(Replica):
    def __init__(self, replica_id: int, profile: ServiceProfile, launched_s: float) -> None:
        super().__init__(replica_id, profile, launched_s)
        self.step = 0  # steps completed at epoch_s
        self.epoch_s = launched_s
        self.running: list[tuple[int, int, SimRequest]] = []  # heap of (finish step, id, req)
        self.context_offset = 0  # sum over running of (context at join - join step)
        self.reserved_tokens = 0
        self.waiting: deque[SimRequest] = deque()
        self.waiting_tokens = 0

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def load_tokens(self) -> int:
        return self.reserved_tokens + self.waiting_tokens

    def _steps_time(self, num_steps: int) -> float:
        p = self.profile
        batch = len(self.running)
        context = self.context_offset + batch * self.step
        first = (
            p.decode_base_s + p.decode_s_per_seq * batch + p.decode_s_per_context_token * context
        )
        growth = p.decode_s_per_context_token * batch
        return num_steps * first + growth * num_steps * (num_steps - 1) / 2

    def _steps_to_reach(self, delta_s: float) -> int:
        """The fewest whole steps whose time is >= delta_s (the step boundary at or after it)."""
        if delta_s <= 0:
            return 0
        p = self.profile
        batch = len(self.running)
        first = p.decode_base_s + p.decode_s_per_seq * batch
        first += p.decode_s_per_context_token * (self.context_offset + batch * self.step)
        growth = p.decode_s_per_context_token * batch
        if growth > 0:
            b = first - growth / 2
            k = math.ceil((-b + math.sqrt(b * b + 2 * growth * delta_s)) / growth)
        else:
            k = math.ceil(delta_s / first)
        while k > 0 and self._steps_time(k - 1) >= delta_s:
            k -= 1
        while self._steps_time(k) < delta_s:
            k += 1
        return k

    def _advance(self, num_steps: int) -> list[SimRequest]:
        self.epoch_s += self._steps_time(num_steps)
        self.step += num_steps
        done: list[SimRequest] = []
        while self.running and self.running[0][0] <= self.step:
            _, _, request = heapq.heappop(self.running)
            request.finish_s = self.epoch_s
            self.context_offset -= (
                request.prompt_tokens + 1 - (self.step - request.output_tokens + 1)
            )
            self.reserved_tokens -= request.kv_tokens
            tpot = (self.epoch_s - request.first_token_s) / (request.output_tokens - 1)
            self.samples.append((self.epoch_s, tpot, 0.0))
            done.append(request)
        return done

    def _admit(self) -> None:
        p = self.profile
        while (
            self.waiting
            and len(self.running) < p.decode_max_num_seqs
            and self.reserved_tokens + self.waiting[0].kv_tokens <= p.kv_capacity_tokens
        ):
            request = self.waiting.popleft()
            self.waiting_tokens -= request.kv_tokens
            self.reserved_tokens += request.kv_tokens
            # The first token came from prefill: the context is prompt + 1 and output - 1
            # steps remain.
            self.context_offset += request.prompt_tokens + 1 - self.step
            finish_step = self.step + request.output_tokens - 1
            heapq.heappush(self.running, (finish_step, request.request_id, request))

    def can_admit(self, request: SimRequest) -> bool:
        return (
            not self.waiting
            and len(self.running) < self.profile.decode_max_num_seqs
            and self.reserved_tokens + request.kv_tokens <= self.profile.kv_capacity_tokens
        )

    def add(self, request: SimRequest, now_s: float) -> list[SimRequest]:
        """Queue a handed-off sequence; it joins at the next step boundary if it fits."""
        done: list[SimRequest] = []
        if self.running:
            limit = self.running[0][0] - self.step
            done = self._advance(min(self._steps_to_reach(now_s - self.epoch_s), limit))
        else:
            self.epoch_s = max(self.epoch_s, now_s)
        self.waiting.append(request)
        self.waiting_tokens += request.kv_tokens
        self._admit()
        return done

    def on_finish_event(self) -> list[SimRequest]:
        """Advance to the next finishing step; admit what now fits."""
        done = self._advance(self.running[0][0] - self.step) if self.running else []
        self._admit()
        return done

    def next_finish_s(self) -> float | None:
        if not self.running:
            return None
        return self.epoch_s + self._steps_time(self.running[0][0] - self.step)

    def report(self, now_s: float, window_s: float) -> DecodeReplicaReport:
        self.prune(now_s, window_s)
        return DecodeReplicaReport(
            tpot_s=tuple(s[1] for s in self.samples if s[0] <= now_s),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.reserved_tokens / self.profile.kv_capacity_tokens,
        )
