"""Replica-side autoscaling windows: what a prefill or decode replica returns from Serve's
`record_autoscaling_stats()`. Pure: the clock is injected, no ray or vllm.

Calls, per replica:

    prefill   token = window.request_started(num_prompt_tokens)   when a prefill arrives
              window.request_finished(token, queue_wait_s=..., compute_s=...)
                                                                   when its first token is out
              window.request_aborted(token)                        when it failed or was cancelled
              window.report()                                      each Serve record interval
    decode    window.record_tpot(tpot_s)                           per finished request
              window.report(num_running, num_waiting, kv_cache_usage)
                                                                   each Serve record interval

Every `request_started` must end in exactly one `request_finished` or `request_aborted`, or its
tokens stay pending forever and the pool looks overloaded. Reports use the keys below, which
the Serve policies read back (autoscaling/serve_metrics.py); a latency key holds the configured
percentile (named `_p95_s` whatever it is) or NO_SAMPLE when the window holds no sample. Not
thread-safe: a Serve replica calls it from its one event loop.

Here, in the layer both replica pools import, and not in autoscaling/ (a layer above them):
`percentile` is also what the policies aggregate with.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, TypeVar

Clock = Callable[[], float]
T = TypeVar("T")

# A metric cannot be None: an empty window reports this.
NO_SAMPLE = -1.0

TTFT_P95_S = "ttft_p95_s"
QUEUE_WAIT_P95_S = "queue_wait_p95_s"
NUM_PENDING_TOKENS = "num_pending_tokens"
NUM_ONGOING_REQUESTS = "num_ongoing_requests"
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
BUSY_FRACTION = "busy_fraction"
PREFILL_METRIC_KEYS = (
    TTFT_P95_S,
    QUEUE_WAIT_P95_S,
    NUM_PENDING_TOKENS,
    NUM_ONGOING_REQUESTS,
    PREFILL_TOKENS_PER_S,
    BUSY_FRACTION,
)

TPOT_P95_S = "tpot_p95_s"
NUM_RUNNING = "num_running"
NUM_WAITING = "num_waiting"
KV_CACHE_USAGE = "kv_cache_usage"
DECODE_METRIC_KEYS = (TPOT_P95_S, NUM_RUNNING, NUM_WAITING, KV_CACHE_USAGE)
# The split's signals (autoscaling/roles.py), which no policy requires: the configured
# percentile of the prompts' compute seconds per chunked-prefill step (a prompt's compute over
# its chunks: what one step of it costs the streams beside it), of those computed for other
# engines (a prefill window's) and of those an engine computed and then decoded itself (the
# router's local prefills); and the median TPOT, the gap the streams take anyway.
PREFILL_STEP_P95_S = "prefill_step_p95_s"
LOCAL_PREFILL_STEP_P95_S = "local_prefill_step_p95_s"
TPOT_P50_S = "tpot_p50_s"


class TimedSample(NamedTuple):
    """One latency observation: when it was taken, and its value in seconds."""

    at_s: float
    value_s: float


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); None if empty."""
    return percentile_of(values, q) if values else None


def percentile_of(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of non-empty `values`, linearly interpolated between the
    closest ranks (numpy's default). pdserve's one percentile: status, autoscaling and the
    benchmarks all read latencies through it."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class _Started(NamedTuple):
    at_s: float
    num_prompt_tokens: int


class _Prefilled(NamedTuple):
    """One finished prefill: its compute interval and the tokens it computed."""

    start_s: float
    end_s: float
    num_tokens: int


class _Window:
    """Timed samples kept for `window_s`; the shared part of both windows."""

    def __init__(self, window_s: float, percentile: float, clock: Clock) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.window_s = window_s
        self.percentile = percentile
        self._clock = clock

    def _now(self) -> float:
        return self._clock()

    def _percentile_or_no_sample(
        self, samples: deque[TimedSample], now_s: float, q: float | None = None
    ) -> float:
        _expire(samples, now_s - self.window_s, lambda s: s.at_s)
        values = [s.value_s for s in samples]
        return _or_no_sample(percentile(values, self.percentile if q is None else q))


class PrefillWindow(_Window):
    """A prefill replica's TTFT and queue-wait samples, pending prompt tokens and busy time.
    `chunk_tokens`: the engine's chunked-prefill token budget (None: a prompt is one step)."""

    def __init__(
        self,
        window_s: float,
        percentile: float,
        clock: Clock = time.monotonic,
        chunk_tokens: int | None = None,
    ) -> None:
        super().__init__(window_s, percentile, clock)
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self._chunk_tokens = chunk_tokens
        self._created_at_s = clock()
        self._ttft: deque[TimedSample] = deque()
        self._queue_wait: deque[TimedSample] = deque()
        self._prefilled: deque[_Prefilled] = deque()
        self._ongoing: dict[int, _Started] = {}
        self._tokens = itertools.count()

    @property
    def num_ongoing_requests(self) -> int:
        return len(self._ongoing)

    @property
    def num_pending_tokens(self) -> int:
        """Prompt tokens of the requests started and not yet finished or aborted."""
        return sum(started.num_prompt_tokens for started in self._ongoing.values())

    def request_started(self, num_prompt_tokens: int) -> int:
        """A prefill arrived; returns the token its `request_finished` / `_aborted` takes."""
        if isinstance(num_prompt_tokens, bool) or num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be an int >= 0, got {num_prompt_tokens!r}")
        token = next(self._tokens)
        self._ongoing[token] = _Started(self._now(), int(num_prompt_tokens))
        return token

    def request_finished(
        self,
        token: int,
        *,
        queue_wait_s: float,
        compute_s: float,
        ttft_s: float | None = None,
    ) -> None:
        """The first token is out. `compute_s` is the engine's prefill time (scheduled -> first
        token), `queue_wait_s` its wait before; `ttft_s` defaults to the time since
        `request_started`, the replica's own view of TTFT."""
        started = self._pop(token)
        for name, value in (("queue_wait_s", queue_wait_s), ("compute_s", compute_s)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        now = self._now()
        ttft = now - started.at_s if ttft_s is None else ttft_s
        self._ttft.append(TimedSample(now, max(ttft, 0.0)))
        self._queue_wait.append(TimedSample(now, queue_wait_s))
        # Finishes arrive in clock order, so the deque stays sorted by end time.
        self._prefilled.append(_Prefilled(now - compute_s, now, started.num_prompt_tokens))
        self._expire(now)

    def request_aborted(self, token: int) -> None:
        """The prefill failed or was cancelled: its tokens are no longer pending, no sample."""
        self._pop(token)

    def report(self) -> dict[str, float]:
        """The window as Serve metrics (keys in `serve_metrics.PREFILL_METRIC_KEYS`)."""
        now = self._now()
        self._expire(now)
        # Batched prefills overlap in time: busy time is the union of the intervals, so a
        # batch of two 1-second prefills is one busy second at twice the speed.
        busy_s = _union_length((p.start_s, p.end_s) for p in self._prefilled)
        window_start = now - self.window_s
        busy_in_window_s = _union_length(
            (max(p.start_s, window_start), p.end_s) for p in self._prefilled
        )
        # A replica younger than the window has not been idle before it existed.
        observed_s = min(self.window_s, now - self._created_at_s)
        tokens = sum(p.num_tokens for p in self._prefilled)
        return {
            TTFT_P95_S: self._percentile_or_no_sample(self._ttft, now),
            QUEUE_WAIT_P95_S: self._percentile_or_no_sample(self._queue_wait, now),
            NUM_PENDING_TOKENS: float(self.num_pending_tokens),
            NUM_ONGOING_REQUESTS: float(self.num_ongoing_requests),
            PREFILL_TOKENS_PER_S: tokens / busy_s if busy_s > 0 else 0.0,
            BUSY_FRACTION: min(busy_in_window_s / observed_s, 1.0) if observed_s > 0 else 0.0,
            PREFILL_STEP_P95_S: _or_no_sample(
                percentile([self._step_s(p) for p in self._prefilled], self.percentile)
            ),
        }

    def _step_s(self, prefilled: _Prefilled) -> float:
        return step_seconds(
            prefilled.end_s - prefilled.start_s, prefilled.num_tokens, self._chunk_tokens
        )

    def _pop(self, token: int) -> _Started:
        try:
            return self._ongoing.pop(token)
        except KeyError:
            raise ValueError(f"unknown or already ended prefill token {token!r}") from None

    def _expire(self, now_s: float) -> None:
        start = now_s - self.window_s
        _expire(self._ttft, start, lambda s: s.at_s)
        _expire(self._queue_wait, start, lambda s: s.at_s)
        _expire(self._prefilled, start, lambda p: p.end_s)


class DecodeWindow(_Window):
    """A decode replica's TPOT samples; batch and KV state come from the engine at report time."""

    def __init__(self, window_s: float, percentile: float, clock: Clock = time.monotonic) -> None:
        super().__init__(window_s, percentile, clock)
        self._tpot: deque[TimedSample] = deque()

    def record_tpot(self, tpot_s: float) -> None:
        """A request finished with this mean time per output token (one sample per request)."""
        if not tpot_s >= 0:
            raise ValueError(f"tpot_s must be >= 0, got {tpot_s}")
        now = self._now()
        self._tpot.append(TimedSample(now, tpot_s))
        _expire(self._tpot, now - self.window_s, lambda s: s.at_s)

    def report(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> dict[str, float]:
        """The window as Serve metrics (keys in `serve_metrics.DECODE_METRIC_KEYS`)."""
        now = self._now()
        return {
            TPOT_P95_S: self._percentile_or_no_sample(self._tpot, now),
            NUM_RUNNING: float(num_running),
            NUM_WAITING: float(num_waiting),
            KV_CACHE_USAGE: float(kv_cache_usage),
            TPOT_P50_S: self._percentile_or_no_sample(self._tpot, now, 50.0),
        }


def step_seconds(compute_s: float, num_tokens: int, chunk_tokens: int | None) -> float:
    """A prompt's compute per chunked-prefill step: `compute_s` over ceil(num_tokens /
    chunk_tokens) steps (None: one step). What one step of it costs the streams beside it; the
    split's signal here and in the planner's model (deploy/plan.py)."""
    steps = 1 if chunk_tokens is None else max(1, math.ceil(num_tokens / chunk_tokens))
    return compute_s / steps


def _or_no_sample(value: float | None) -> float:
    return NO_SAMPLE if value is None else value


def _expire(items: deque[T], start_s: float, at: Callable[[T], float]) -> None:
    """Drop the items taken at or before `start_s` (the window is (now - window_s, now])."""
    while items and at(items[0]) <= start_s:
        items.popleft()


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals; empty ones count nothing."""
    merged_s = 0.0
    current: tuple[float, float] | None = None
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if current is None or start > current[1]:
            if current is not None:
                merged_s += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        merged_s += current[1] - current[0]
    return merged_s
