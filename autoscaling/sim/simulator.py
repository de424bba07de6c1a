"""Discrete-event simulator of a P/D deployment driven by an arrival trace and two policies.

    arrival ─> prefill replica (power of two on pending tokens, FIFO, batches up to a token
               budget) ─> first token (TTFT) ─> KV handoff ─> decode replica (power of two on
               KV tokens; joins at a step boundary when it fits) ─> finish (TPOT)
    every tick: replica reports ─> aggregate ─> policy ─> launch / cancel / drain replicas

New replicas serve after `profile.startup_s`; retired ones finish their work first and cost
replica-seconds until then. The run goes on after the trace until every request is done (or
`drain_limit_s` passes), so each arrival ends finished, rejected or counted as unfinished.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from autoscaling.config import DEFAULT_SLO
from autoscaling.policy import Decision
from autoscaling.signals import RouterQueueReport, aggregate_decode, aggregate_prefill
from autoscaling.sim.pool_policies import PoolPolicies
from autoscaling.sim.pools import SimPool, stop_if_drained
from autoscaling.sim.profiles import CPU_FP32_1CORE, ServiceProfile
from autoscaling.sim.replicas import DecodeReplica, PrefillReplica, SimRequest
from autoscaling.sim.results import PoolEvent, PoolName, RequestOutcome, SimResult
from autoscaling.sim.trace import ArrivalTrace
from control.records import PoolSLO


@dataclass(frozen=True)
class SimSettings:
    profile: ServiceProfile = CPU_FP32_1CORE
    slo: PoolSLO = DEFAULT_SLO
    initial_prefill_replicas: int = 1
    initial_decode_replicas: int = 1
    tick_s: float = 10.0
    window_s: float = 60.0
    # The router's arrival rate is taken over a shorter window: it sizes scale-ups.
    rate_window_s: float = 20.0
    percentile: float = 95.0
    drain_limit_s: float = 3600.0
    routing_seed: int = 0


class _Kind(IntEnum):
    TICK = 0
    READY = 1
    PREFILL_DONE = 2
    HANDOFF = 3
    DECODE_FINISH = 4


def simulate(trace: ArrivalTrace, policies: PoolPolicies, settings: SimSettings) -> SimResult:
    return _Simulation(trace, policies, settings).run()


class _Simulation:
    def __init__(self, trace: ArrivalTrace, policies: PoolPolicies, settings: SimSettings) -> None:
        self.trace = trace
        self.policies = policies
        self.settings = settings
        self.profile = settings.profile
        self.rng = random.Random(settings.routing_seed)
        self.events: list[tuple[float, int, _Kind, Any, int]] = []
        self.counter = 0
        self.prefill: SimPool[PrefillReplica] = SimPool(PrefillReplica, self.profile)
        self.decode: SimPool[DecodeReplica] = SimPool(DecodeReplica, self.profile)
        # The router's queues: requests wait here until a replica has room.
        self.prefill_queue: deque[SimRequest] = deque()
        self.prefill_queued_tokens = 0
        self.prefill_idle: list[PrefillReplica] = []
        self.prefill_arrivals: deque[tuple[float, int]] = deque()
        self.decode_backlog: deque[SimRequest] = deque()
        self.requests: list[SimRequest] = []
        self.rejected: set[int] = set()
        self.num_done = 0
        self.scale_events: list[PoolEvent] = []

    def _push(self, at_s: float, kind: _Kind, payload: object, version: int = 0) -> None:
        self.counter += 1
        heapq.heappush(self.events, (at_s, self.counter, kind, payload, version))

    def run(self) -> SimResult:
        for _ in range(self.settings.initial_prefill_replicas):
            self.prefill_idle.append(self.prefill.launch(0.0, ready_now=True))
        for _ in range(self.settings.initial_decode_replicas):
            self.decode.launch(0.0, ready_now=True)
        arrivals = self.trace.requests()
        end_of_trace = self.trace.duration_s
        deadline = end_of_trace + self.settings.drain_limit_s
        self._push(self.settings.tick_s, _Kind.TICK, None)
        now = 0.0
        next_arrival = 0
        while True:
            arrival_s = (
                arrivals[next_arrival].arrival_s if next_arrival < len(arrivals) else math.inf
            )
            if arrival_s <= self.events[0][0]:
                now = arrival_s
                a = arrivals[next_arrival]
                next_arrival += 1
                request = SimRequest(a.request_id, a.arrival_s, a.prompt_tokens, a.output_tokens)
                self.requests.append(request)
                self._route_prefill(request, now)
                continue
            now, _, kind, payload, version = heapq.heappop(self.events)
            if kind is _Kind.TICK:
                finished = next_arrival == len(arrivals) and self._num_settled() == len(arrivals)
                if now >= deadline or (now >= end_of_trace and finished):
                    break
                self._tick(now)
                self._push(now + self.settings.tick_s, _Kind.TICK, None)
            elif kind is _Kind.READY:
                self._on_ready(payload, now)
            elif kind is _Kind.PREFILL_DONE:
                self._on_prefill_done(payload, now)
            elif kind is _Kind.HANDOFF:
                self._route_decode(payload, now)
            elif kind is _Kind.DECODE_FINISH and version == payload.version:
                self._on_decode_finish(payload, now)
        return self._result(now)

    def _num_settled(self) -> int:
        return self.num_done + len(self.rejected)

    # Prefill side: idle replicas pull batches from the router's queue.
    def _route_prefill(self, request: SimRequest, now_s: float) -> None:
        self.prefill_queue.append(request)
        self.prefill_queued_tokens += request.prompt_tokens
        self.prefill_arrivals.append((now_s, request.prompt_tokens))
        self._dispatch_prefill(now_s)

    def _dispatch_prefill(self, now_s: float) -> None:
        while self.prefill_queue and self.prefill_idle:
            replica = self.prefill_idle.pop()
            if replica.is_draining:
                continue
            self._start_prefill(replica, now_s)

    def _start_prefill(self, replica: PrefillReplica, now_s: float) -> None:
        end_s = replica.start_batch(self.prefill_queue, now_s)
        self.prefill_queued_tokens -= replica.num_pending_tokens
        self._push(end_s, _Kind.PREFILL_DONE, replica)

    def _on_prefill_done(self, replica: PrefillReplica, now_s: float) -> None:
        for request in replica.finish_batch(now_s):
            handoff_s = request.prompt_tokens * self.profile.transfer_s_per_token
            self._push(now_s + handoff_s, _Kind.HANDOFF, request)
        if replica.is_draining:
            stop_if_drained(replica, now_s)
        elif self.prefill_queue:
            self._start_prefill(replica, now_s)
        else:
            self.prefill_idle.append(replica)

    # Decode side: a sequence goes to the less loaded of two replicas if it fits there, else
    # waits at the router until a replica frees room.
    def _route_decode(self, request: SimRequest, now_s: float) -> None:
        if request.kv_tokens > self.profile.kv_capacity_tokens:
            self.rejected.add(request.request_id)
            return
        if not self.decode_backlog:
            for replica in self.decode.pick_two(self.rng, _kv_load):
                if replica.can_admit(request):
                    self._add_decode(replica, request, now_s)
                    return
        self.decode_backlog.append(request)

    def _add_decode(self, replica: DecodeReplica, request: SimRequest, now_s: float) -> None:
        self._settle(replica.add(request, now_s))
        self._schedule_decode(replica)

    def _pull_decode(self, replica: DecodeReplica, now_s: float) -> None:
        while self.decode_backlog and replica.can_admit(self.decode_backlog[0]):
            self._add_decode(replica, self.decode_backlog.popleft(), now_s)

    def _schedule_decode(self, replica: DecodeReplica) -> None:
        replica.version += 1
        finish_s = replica.next_finish_s()
        if finish_s is not None:
            self._push(finish_s, _Kind.DECODE_FINISH, replica, replica.version)

    def _on_decode_finish(self, replica: DecodeReplica, now_s: float) -> None:
        self._settle(replica.on_finish_event())
        self._schedule_decode(replica)
        if replica.is_draining:
            stop_if_drained(replica, now_s)
        else:
            self._pull_decode(replica, now_s)

    def _settle(self, done: list[SimRequest]) -> None:
        self.num_done += len(done)

    # Scaling.
    def _on_ready(self, replica: PrefillReplica | DecodeReplica, now_s: float) -> None:
        if isinstance(replica, PrefillReplica):
            if self.prefill.mark_ready(replica):
                self.prefill_idle.append(replica)
                self._dispatch_prefill(now_s)
        elif self.decode.mark_ready(replica):
            self._pull_decode(replica, now_s)

    def _tick(self, now_s: float) -> None:
        window, q = self.settings.window_s, self.settings.percentile
        prefill_reports = [r.report(now_s, window) for r in self.prefill.serving]
        rate_window = self.settings.rate_window_s
        while self.prefill_arrivals and self.prefill_arrivals[0][0] <= now_s - rate_window:
            self.prefill_arrivals.popleft()
        router = RouterQueueReport(
            num_queued_requests=len(self.prefill_queue),
            num_queued_tokens=self.prefill_queued_tokens,
            arrived_tokens_per_s=sum(a[1] for a in self.prefill_arrivals) / min(rate_window, now_s),
        )
        prefill_signals = aggregate_prefill(prefill_reports, q, len(self.prefill.starting), router)
        decision = self.policies.prefill(prefill_signals, self.prefill.history, now_s)
        self._apply("prefill", self.prefill, decision, now_s, _pending_tokens)
        for replica in self.decode.serving:  # a sweep for what the two random choices missed
            self._pull_decode(replica, now_s)
        decode_reports = [r.report(now_s, window) for r in self.decode.serving]
        decode_signals = aggregate_decode(
            decode_reports, q, len(self.decode.starting), len(self.decode_backlog)
        )
        decision = self.policies.decode(decode_signals, self.decode.history, now_s)
        self._apply("decode", self.decode, decision, now_s, _kv_load)

    def _apply(
        self,
        pool_name: PoolName,
        pool: SimPool[Any],
        decision: Decision,
        now_s: float,
        load: Callable[[Any], float],
    ) -> None:
        pool.history = decision.history
        if decision.is_scale_event:
            event = decision.history.events[-1]
            self.scale_events.append(
                PoolEvent("prefill" if pool_name == "prefill" else "decode", event)
            )
        for replica in pool.scale_to(decision.target_replicas, now_s, load):
            self._push(replica.ready_s, _Kind.READY, replica)

    def _result(self, end_s: float) -> SimResult:
        outcomes = tuple(
            RequestOutcome(
                r.request_id,
                r.arrival_s,
                r.first_token_s - r.arrival_s,
                (r.finish_s - r.first_token_s) / (r.output_tokens - 1),
                r.request_id in self.rejected,
            )
            for r in self.requests
        )
        return SimResult(
            policy_name=self.policies.name,
            slo=self.settings.slo,
            trace_duration_s=self.trace.duration_s,
            end_s=end_s,
            outcomes=outcomes,
            events=tuple(self.scale_events),
            prefill_replica_s=self.prefill.replica_seconds(end_s),
            decode_replica_s=self.decode.replica_seconds(end_s),
            peak_prefill_replicas=self.prefill.peak,
            peak_decode_replicas=self.decode.peak,
        )


def _pending_tokens(replica: PrefillReplica) -> float:
    return replica.num_pending_tokens


def _kv_load(replica: DecodeReplica) -> float:
    return replica.load_tokens
