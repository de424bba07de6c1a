"""Where a new request's prompt is computed: on the decode replica that will decode it ("local":
no KV crosses the wire, but that engine's running streams wait while it computes) or on the
prefill pool ("remote": that pool's queue, then the KV transfer). Each path's time to first
token is predicted from the pools' last reported queues and from rates fitted online to the
router's own finished requests; the local path must also leave the decode streams within their
TPOT SLO. Conditional disaggregation as Dynamo and llm-d do it, with a prediction where they
use a fixed threshold of uncached tokens.

    remote TTFT = a + queue_left(prefill replica) + b x uncached there + transfer_s(prompt)
    local TTFT  = queue_left(decode replica) + a + b x prompt tokens
    stall       = a + b x prompt tokens: the decode replica's streams wait that once, which
                  over their mean output length must fit in (TPOT SLO - observed TPOT) each;
                  observed TPOT is the P95 of the last 64 requests' (the SLO is a P95: a
                  mean let local prefills pile up until half the streams missed it)
    or, with the one-token budget ("token"), b x prompt tokens (the step's fixed cost a is in
                  the streams' gap already) must fit in one gap's headroom: the ITL SLO
                  (else the TPOT SLO) less the median TPOT of the last 64 requests
    queue_left  = max(0, b x queued tokens - seconds since the queue was reported)

`a + b x tokens` (prefill compute) and `transfer_s` are least-squares lines over the last
observations, seconds against tokens. A missing signal (no fit yet, no load seen or one too
old) means local: the request costs no transfer and feeds the prefill fit; so does a split
that left no engine serving prefill (autoscaling/roles.py). Only remote requests
teach the transfer rate, so until it is fitted one request in `EXPLORE_EVERY` goes remote.
Pure: the router feeds observations and snapshots in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Path = Literal["local", "remote"]

# Until the transfer rate is fitted, one request in this many goes remote to measure it.
EXPLORE_EVERY = 4
# Answers shorter than this tell the decider nothing of TPOT.
MIN_TPOT_TOKENS = 8


class LinearFit:
    """seconds ~ intercept + slope x tokens, least squares over the last `window` samples;
    None until `min_samples` were added. When the tokens have too little spread to separate
    the two (or noise makes either negative), `fallback` says what the samples are taken to
    be: "proportional" (through the origin: compute) or "constant" (their mean: a transfer's
    fixed costs, the hop and a decode step, dominate its bytes here)."""

    def __init__(
        self,
        window: int = 64,
        min_samples: int = 3,
        fallback: Literal["proportional", "constant"] = "proportional",
    ) -> None:
        if window < 2 or not 1 <= min_samples <= window:
            raise ValueError(
                f"need window >= 2 and 1 <= min_samples <= window, got {window}, {min_samples}"
            )
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._min_samples = min_samples
        self._fallback = fallback
        # The line of the current samples: fitted once per sample, read on every decision.
        self._line: tuple[float, float] | None = None

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, tokens: float, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self._samples.append((float(tokens), float(seconds)))
            self._line = self._fit()

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope), or None before `min_samples`."""
        return self._line

    def _fit(self) -> tuple[float, float] | None:
        if len(self._samples) < self._min_samples:
            return None
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var_x > 1e-9 * max(1.0, mean_x**2) * n:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var_x
            intercept = mean_y - slope * mean_x
            if slope >= 0 and intercept >= 0:
                return intercept, slope
        if self._fallback == "constant":
            return mean_y, 0.0
        through_origin = sum(x * y for x, y in self._samples) / sum(x * x for x, _ in self._samples)
        return 0.0, through_origin

    def predict(self, tokens: float) -> float | None:
        line = self.line()
        return None if line is None else line[0] + line[1] * max(0.0, tokens)


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of non-empty `values` by the nearest rank: a value seen."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def request_itl_s(gaps: Sequence[float]) -> float:
    """A request's ITL as an ITL SLO judges it (the planner and the bench alike): the P99 of
    its inter-token gaps by the nearest rank, so its largest gap under 100 of them; 0 with no
    gap."""
    return nearest_rank(gaps, 0.99) if gaps else 0.0


class RecentQuantile:
    """The q-quantile of the last `window` values (`nearest_rank`); None before the first."""

    def __init__(self, q: float, window: int = 64) -> None:
        if not 0 < q <= 1 or window < 1:
            raise ValueError(f"need 0 < q <= 1 and window >= 1, got {q}, {window}")
        self._q = q
        self._values: deque[float] = deque(maxlen=window)
        self.value: float | None = None

    def add(self, value: float) -> None:
        self._values.append(value)
        self.value = nearest_rank(self._values, self._q)


class Mean:
    """An exponentially weighted mean; None before the first value."""

    def __init__(self, weight: float = 0.1) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self._weight = weight
        self.value: float | None = None

    def add(self, value: float) -> None:
        self.value = (
            value if self.value is None else self.value + self._weight * (value - self.value)
        )


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool's replica a request would most likely go to, as last reported."""

    queue_tokens: int  # prompt tokens it accepted and has not prefilled yet
    num_running: int  # streams it is decoding
    age_s: float  # since the report was seen


@dataclass(frozen=True)
class PDInputs:
    num_prompt_tokens: int
    # Of those, the tokens the prefill replica holds already (the prefix index).
    num_cached_remote: int
    prefill: PoolSnapshot | None
    decode: PoolSnapshot | None
    # Known: no engine takes prefill calls now (the split lent them all to decoding).
    no_prefill_engine: bool = False


@dataclass(frozen=True)
class PDDecision:
    path: Path
    reason: str
    local_ttft_s: float | None = None
    remote_ttft_s: float | None = None
    stall_s: float | None = None
    headroom_s: float | None = None

    def describe(self) -> str:
        def s(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}s"

        return (
            f"{self.path}: {self.reason} (local {s(self.local_ttft_s)}, remote "
            f"{s(self.remote_ttft_s)}, stall {s(self.stall_s)} of {s(self.headroom_s)})"
        )


StallBudget = Literal["stream", "token"]


class PDDecider:
    """The decision and what it learns from. `tpot_slo_s`: the decode streams' TPOT target;
    `max_snapshot_age_s`: a decode pool load older than this is no signal. `stall_budget`:
    how long a local prefill may stall the decode engine's running streams: "stream", the
    TPOT headroom over a stream's mean output (the streams stay within the SLO, though one
    long prompt may stall them seconds); "token", one token's headroom (a stall no longer
    than one more step each stream can afford: long prompts go remote while streams run),
    measured against `itl_slo_s` where one is set (an ITL SLO bounds each gap), else the
    TPOT SLO."""

    def __init__(
        self,
        tpot_slo_s: float,
        max_snapshot_age_s: float = 10.0,
        window: int = 64,
        stall_budget: StallBudget = "stream",
        itl_slo_s: float | None = None,
    ) -> None:
        if stall_budget not in ("stream", "token"):
            raise ValueError(f"stall_budget must be 'stream' or 'token', got {stall_budget!r}")
        self.stall_budget = stall_budget
        if tpot_slo_s <= 0 or max_snapshot_age_s <= 0:
            raise ValueError(
                f"tpot_slo_s and max_snapshot_age_s must be > 0, got {tpot_slo_s}, "
                f"{max_snapshot_age_s}"
            )
        if itl_slo_s is not None and itl_slo_s <= 0:
            raise ValueError(f"itl_slo_s must be > 0, got {itl_slo_s}")
        self.tpot_slo_s = tpot_slo_s
        self.itl_slo_s = itl_slo_s
        self.max_snapshot_age_s = max_snapshot_age_s
        self.prefill = LinearFit(window)  # compute seconds against prompt tokens computed
        # The decode call to decode's first token, against prompt tokens.
        self.transfer = LinearFit(window, fallback="constant")
        self.tpot = RecentQuantile(0.95, window)
        self.tpot_median = RecentQuantile(0.5, window)
        self.output_tokens = Mean()
        self._num_unfitted = 0

    def observe(
        self,
        num_prompt_tokens: int,
        prefill_s: float,
        kv_transfer_s: float | None,
        mean_tpot_s: float | None,
        num_output_tokens: int,
    ) -> None:
        """One finished request: its prompt's compute time (either path), its KV transfer
        (remote only), and its decode rate. The TPOT of an answer shorter than
        `MIN_TPOT_TOKENS` is left out: over so few gaps it is mostly the one handoff."""
        self.prefill.add(num_prompt_tokens, prefill_s)
        if kv_transfer_s is not None:
            self.transfer.add(num_prompt_tokens, kv_transfer_s)
        if mean_tpot_s is not None and num_output_tokens >= MIN_TPOT_TOKENS:
            self.tpot.add(mean_tpot_s)
            self.tpot_median.add(mean_tpot_s)
            self.output_tokens.add(num_output_tokens)

    def decide(self, inputs: PDInputs) -> PDDecision:
        if inputs.no_prefill_engine:
            return PDDecision("local", "no engine serves prefill")
        if self.transfer.line() is None:
            # Only remote requests teach the transfer rate: one in `EXPLORE_EVERY` goes there
            # until it is fitted (else a missing rate would keep every request local).
            self._num_unfitted += 1
            if self._num_unfitted % EXPLORE_EVERY == 1:
                return PDDecision("remote", "learning the transfer rate")
        missing = self._missing(inputs)
        if missing is not None:
            return PDDecision("local", f"no {missing}")
        assert inputs.prefill is not None and inputs.decode is not None
        intercept, per_token = _known_line(self.prefill.line())
        uncached_remote = max(0, inputs.num_prompt_tokens - inputs.num_cached_remote)
        remote = (
            intercept
            + _queue_left_s(inputs.prefill, per_token)
            + per_token * uncached_remote
            + _known(self.transfer.predict(inputs.num_prompt_tokens))
        )
        stall = intercept + per_token * inputs.num_prompt_tokens
        local = _queue_left_s(inputs.decode, per_token) + stall
        headroom = None
        if inputs.decode.num_running > 0:
            # The streams on that engine wait `stall` once; over a stream's output that adds
            # stall / tokens to its mean TPOT, which must stay under the SLO where the
            # recent tail already is ("stream"). Or that one gap must stay under the ITL
            # (else TPOT) SLO ("token"): the gap is the step the streams take anyway (their
            # median TPOT, which holds the step's fixed cost, the fit's intercept) plus the
            # prompt's own compute.
            if self.stall_budget == "stream":
                added, slo_name = stall, "TPOT"
                headroom = max(0.0, self.tpot_slo_s - _known(self.tpot.value)) * _known(
                    self.output_tokens.value
                )
            else:
                added = per_token * inputs.num_prompt_tokens
                slo_name = "TPOT" if self.itl_slo_s is None else "ITL"
                slo = self.itl_slo_s or self.tpot_slo_s
                headroom = max(0.0, slo - _known(self.tpot_median.value))
            if added > headroom:
                return PDDecision(
                    "remote",
                    f"local would stall {inputs.decode.num_running} streams past the "
                    f"{slo_name} SLO",
                    local,
                    remote,
                    added,
                    headroom,
                )
        if local <= remote:
            return PDDecision("local", "local is sooner", local, remote, stall, headroom)
        return PDDecision("remote", "remote is sooner", local, remote, stall, headroom)

    def _missing(self, inputs: PDInputs) -> str | None:
        if self.prefill.line() is None:
            return "fitted prefill rate yet"
        if self.transfer.line() is None:
            return "fitted transfer rate yet"
        # The prefill pool's load may be old (it is seen when a request is routed there): its
        # queue is taken as worked off meanwhile. The decode pool is seen on every request.
        if inputs.prefill is None:
            return "prefill pool load"
        if inputs.decode is None or inputs.decode.age_s > self.max_snapshot_age_s:
            return "recent decode pool load"
        running = inputs.decode is not None and inputs.decode.num_running > 0
        if running and (self.tpot.value is None or self.output_tokens.value is None):
            return "observed TPOT yet"
        return None


def _queue_left_s(snapshot: PoolSnapshot, per_token_s: float) -> float:
    """The reported queue's compute time, less what was worked off since the report."""
    return max(0.0, per_token_s * snapshot.queue_tokens - snapshot.age_s)


def _known_line(line: tuple[float, float] | None) -> tuple[float, float]:
    assert line is not None  # `_missing` ruled it out
    return line


def _known(value: float | None) -> float:
    assert value is not None  # `_missing` ruled it out
    return value
