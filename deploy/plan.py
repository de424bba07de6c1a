"""The planner (`pdserve plan`, `topology: auto`): which topology and P:D split serve a workload
best on a number of engines, predicted from a sim profile's step times.

Each candidate is run through a discrete-event model of the app on a virtual clock: the sim
engine's own scheduler (engine/sim/scheduler.py: vLLM's continuous batching, chunked-prefill
budget, KV blocks and preemption) on each engine, each step as long as the profile says, KV
moved over the profile's link. The candidates for N engines:

- `colocated`: N engines, each prefills and decodes its own requests;
- `disaggregated P:D`: every prompt on one of P prefill engines, its KV to one of D = N - P
  decode engines;
- `adaptive P:D`: the same pools, each prompt where router/pd_decision.py's decider puts it
  (the router's `adaptive_prefill`, learning its rates from the modelled requests as the
  router does from real ones). `adaptive 0:N` is where a split that may lend every prefill
  engine (`autoscaling.split_min_prefill_engines: 0`) sits while the prompts computed locally
  are few: the decider computes each prompt on its decode engine, so the run is colocated's.
  The model holds each split fixed; the live autoscaler moves between them (roles.py).

A candidate's goodput is the highest Poisson rate at which at least `attainment` of the
requests meet both the TTFT and the TPOT SLO (DistServe's definition), and the ITL SLO where
the workload sets one (the P99 of each request's inter-token gaps, the TBT SLO of Sarathi-Serve
and DynaServe: a long prompt computed beside running streams stalls each of them once, which
a mean TPOT absorbs and an ITL bound does not), found by a rate search
over one seeded trace whose arrival gaps scale with the rate (30 s of arrivals per run), and
never past the work bound: what the engines finish with every second computing, whatever the
topology (`work_bound`), past which a finite run's queue hides a service's endless one. What
the model leaves out: pdserve's own hops (a few ms each, docs/benchmarks.md), routing on stale
loads, and engines sharing CPU cores; so a split must predict `min_gain` times colocated's
goodput to be picked. Every engine is one of the profile's, unless the plan names wider
engines (`plan.wider_engines`: n -> a profile measured on an engine of n cores or GPUs): then
each candidate is also weighed on N // n engines that wide, each timed by its own profile.
And every candidate is weighed at each chunked-prefill budget of `plan.chunk_budgets` (vLLM's
max_num_batched_tokens): a budget under a long prompt's length computes it in several steps,
each a short stall for the streams beside it (Sarathi-Serve), which under an ITL SLO can
serve colocated engines better than any split.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from autoscaling.roles import Stalls
from deploy.config import AppConfig
from deploy.workload import Workload, WorkloadSLO, load_workload
from engine.autoscaling_stats import percentile, percentile_of, step_seconds
from engine.sim.blocks import BlockPool
from engine.sim.profile import Link, SimProfile, load_link, load_profile
from engine.sim.scheduler import SimRequest, SimScheduler, Step
from engine.sim.tokens import TokenSource
from router.pd_decision import PDDecider, PDInputs, PoolSnapshot, nearest_rank, request_itl_s

Kind = Literal["colocated", "disaggregated", "adaptive"]

# Token ids of the modelled prompts: a shared prefix from 0, then ids unique to each request
# (no prefix-cache hit the workload does not have).
_UNIQUE_BASE = 1 << 20
_TOKENS = TokenSource(range(1000))
_MAX_SECONDS_AFTER_LAST = 3600.0  # a run stops this long after its last arrival (overload)
MIN_RATE = 1e-3  # req/s: below it a candidate's goodput is 0
# The profile `topology: auto` predicts with when the app names none and runs no sim engine.
DEFAULT_PROFILE = "cpu-smollm2"


@dataclass(frozen=True)
class EngineShape:
    """What each modelled engine is: the KV cache (bytes; the profile's own when it has one),
    the block size and the batch limits, as the app's engine settings set them."""

    kv_cache_bytes: int | None
    block_size: int = 32
    max_num_seqs: int = 64
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None


@dataclass(frozen=True)
class Candidate:
    kind: Kind
    num_prefill: int  # engines prefilling (0 when colocated)
    num_decode: int  # engines decoding (all of them when colocated)
    # Cores (GPUs) each engine computes on, in units of the plan's base profile: 1 is an
    # engine of `plan.profile`; n, one of `plan.wider_engines[n]`.
    width: int = 1
    # Every engine's chunked-prefill token budget; None: the engine shape's.
    chunk_budget: int | None = None

    @property
    def runs_as_colocated(self) -> bool:
        """Colocated, or adaptive 0:N (no prefill engine: the decider keeps every prompt local,
        so its run is colocated's)."""
        return self.num_prefill == 0

    @property
    def name(self) -> str:
        if self.kind == "colocated":
            name = f"colocated x{self.num_decode}"
        else:
            name = f"{self.kind} {self.num_prefill}:{self.num_decode}"
        if self.width > 1:
            name += f" ({self.width}-wide)"
        return name if self.chunk_budget is None else f"{name} chunk {self.chunk_budget}"


def candidates(
    num_engines: int, width: int = 1, chunk_budget: int | None = None
) -> list[Candidate]:
    if num_engines < 1:
        raise ValueError(f"engines must be >= 1, got {num_engines}")
    found = [Candidate("colocated", 0, num_engines, width, chunk_budget)]
    found += [
        Candidate("disaggregated", p, num_engines - p, width, chunk_budget)
        for p in range(1, num_engines)
    ]
    # Adaptive from 0:N, every engine decoding and the router computing every prompt locally
    # (what `autoscaling.split_min_prefill_engines: 0` lends the prefill engines back to).
    found += [
        Candidate("adaptive", p, num_engines - p, width, chunk_budget)
        for p in range(0 if num_engines > 1 else 1, num_engines)
    ]
    return found


@dataclass(frozen=True)
class Trace:
    """A workload's requests at unit rate: arrival times scale by 1 / rate. A run at a rate
    takes the requests of `duration_s` of arrivals (at least `min_requests`), so a rate past
    the candidate's capacity builds a queue instead of passing as one burst of a fixed
    count; the first n requests are the same at every rate."""

    lengths: tuple[tuple[int, int], ...]  # (prompt tokens with the shared prefix, output)
    unit_arrivals: tuple[float, ...]
    shared_prefix_tokens: int
    duration_s: float
    min_requests: int

    @classmethod
    def of(
        cls,
        workload: Workload,
        seed: int = 0,
        duration_s: float = 30.0,
        min_requests: int = 40,
        max_requests: int = 2000,
    ) -> Trace:
        if not 1 <= min_requests <= max_requests or duration_s <= 0:
            raise ValueError(
                "need 1 <= min_requests <= max_requests and duration_s > 0, got "
                f"{min_requests}, {max_requests}, {duration_s}"
            )
        rng = random.Random(seed)
        arrivals = itertools.accumulate(rng.expovariate(1.0) for _ in range(max_requests))
        prefix = workload.shared_prefix_tokens
        lengths = tuple((prefix + p, o) for p, o in workload.lengths(max_requests, seed))
        return cls(lengths, tuple(arrivals), prefix, duration_s, min_requests)

    def num_requests(self, rate: float) -> int:
        wanted = max(self.min_requests, math.ceil(rate * self.duration_s))
        return min(len(self.lengths), wanted)


@dataclass(frozen=True)
class RunResult:
    rate: float
    attainment: float  # share of the requests meeting every SLO set
    ttft_p90_s: float
    tpot_p90_s: float
    itl_p90_s: float  # the P90 over requests of each one's P99 gap
    num_local: int  # adaptive: prompts computed on their decode engine
    num_remote: int
    # What a local prompt adds to its engine's gap, as the live split reads it (autoscaling/
    # roles.py `Stalls`): the P95 of the local prompts' compute (scheduled -> first token) per
    # chunked-prefill step, less the median TPOT; None without a local prompt.
    local_stall_s: float | None = None


@dataclass(frozen=True)
class CandidatePlan:
    candidate: Candidate
    goodput: float  # req/s; 0 when not even the lowest rate tried meets the SLOs
    at_goodput: RunResult | None


@dataclass(frozen=True)
class Plan:
    workload: str
    profile: str
    num_engines: int
    ttft_slo_s: float
    tpot_slo_s: float
    attainment: float
    results: tuple[CandidatePlan, ...]  # by width, then budget; colocated first in each
    min_gain: float = 1.0
    itl_slo_s: float | None = None
    # No topology of these engines finishes more requests a second of the workload: the
    # engines' seconds over each request's least compute (`work_bound`).
    work_bound_rps: float = math.inf

    def slo_text(self) -> str:
        itl = "" if self.itl_slo_s is None else f" / ITL (P99 gap) {self.itl_slo_s:g} s"
        return f"TTFT {self.ttft_slo_s:g} s / TPOT {self.tpot_slo_s:g} s{itl}"

    @property
    def colocated(self) -> CandidatePlan:
        """The colocated candidate of the highest goodput (of each width there is one); ties
        go to the narrower engines."""
        colocated = (r for r in self.results if r.candidate.kind == "colocated")
        return max(colocated, key=lambda r: r.goodput)

    @property
    def highest(self) -> CandidatePlan:
        """The highest goodput; ties go to the earlier (simpler) candidate."""
        return max(self.results, key=lambda r: r.goodput)

    @property
    def best(self) -> CandidatePlan:
        """The highest, if it beats colocated by `min_gain`; else colocated."""
        highest = self.highest
        if highest.goodput > self.min_gain * self.colocated.goodput:
            return highest
        return self.colocated

    def reason(self) -> str:
        best, highest, colocated = self.best, self.highest, self.colocated
        if highest.goodput == 0:
            return "no candidate meets the SLOs at any rate tried; colocated is the default"
        slo = f"within {self.slo_text()} for {self.attainment:.0%} of requests"
        if best is not highest:
            return (
                f"{colocated.candidate.name} serves {colocated.goodput:.3g} req/s {slo}; "
                f"{highest.candidate.name} predicts {highest.goodput:.3g} "
                f"({highest.goodput / colocated.goodput:.2f}x), under the {self.min_gain:g}x a "
                "split must gain to be picked"
            )
        # Adaptive 0:N is colocated's run again: never the next best of its colocated.
        others = [
            r
            for r in self.results
            if r is not best
            and (r.candidate.kind == "colocated" or not r.candidate.runs_as_colocated)
        ]
        text = f"{best.candidate.name} serves {best.goodput:.3g} req/s {slo}"
        if others:
            runner_up = max(others, key=lambda r: r.goodput)
            ratio = best.goodput / runner_up.goodput if runner_up.goodput else math.inf
            text += f", {ratio:.2f}x the next best ({runner_up.candidate.name})"
        return text


def format_plan(result: Plan) -> str:
    """The candidates as a table, then the pick and why. An adaptive row's "stall s" is what a
    local prompt adds to a gap (`RunResult.local_stall_s`): at 0:N, past the TPOT SLO the live
    split (`split_min_prefill_engines: 0`) takes a prefill engine back."""
    lines = [
        f"plan for workload {result.workload} on {result.num_engines} engines, profile "
        f"{result.profile}: goodput = the highest Poisson rate at which "
        f"{result.attainment:.0%} of requests meet {result.slo_text()}",
        f"{'candidate':<30} {'goodput req/s':>13} {'TTFT P90 s':>10} {'TPOT P90 s':>10} "
        f"{'ITL P90 s':>9} {'local:remote':>12} {'stall s':>7}",
    ]
    for r in result.results:
        at = r.at_goodput
        ttft = f"{at.ttft_p90_s:.3f}" if at else "-"
        tpot = f"{at.tpot_p90_s:.4f}" if at else "-"
        itl = f"{at.itl_p90_s:.4f}" if at else "-"
        adaptive = at is not None and r.candidate.kind == "adaptive"
        split = f"{at.num_local}:{at.num_remote}" if at and adaptive else ""
        stall = at.local_stall_s if at and adaptive else None
        lines.append(
            f"{r.candidate.name:<30} {r.goodput:>13.3f} {ttft:>10} {tpot:>10} {itl:>9} "
            f"{split:>12} {'' if stall is None else f'{stall:.3f}':>7}"
        )
    if math.isfinite(result.work_bound_rps):
        share = result.highest.goodput / result.work_bound_rps
        lines.append(
            f"work bound: {result.work_bound_rps:.3g} req/s, what the engines finish with every "
            "second computing and no step overhead, whatever the topology; the highest "
            f"candidate reaches {share:.2f} of it"
        )
    lines.append(f"pick: {result.reason()}")
    return "\n".join(lines)


def plan(
    workload: Workload,
    profile: SimProfile,
    link: Link,
    num_engines: int,
    shape: EngineShape,
    attainment: float = 0.9,
    trace: Trace | None = None,
    min_gain: float = 1.0,
    wider: Mapping[int, SimProfile] | None = None,
    chunk_budgets: Sequence[int] = (),
) -> Plan:
    """Every candidate's goodput for `workload` (its SLO) on `num_engines` engines of
    `profile`, then, for each width n of `wider`, on num_engines // n engines of n times the
    cores (GPUs) each, timed by wider[n]; each at every one of `chunk_budgets` (none: the
    shape's own budget only). A split is picked over the best colocated candidate only for
    `min_gain` times its goodput."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    sized = {1: profile, **(wider or {})}
    for width, each in sized.items():
        if width < 1 or num_engines // width < 1:
            raise ValueError(
                f"an engine {width} wide does not fit {num_engines} engines' cores (GPUs)"
            )
        if not any(vars(each.step).values()):
            raise ValueError(
                f"sim profile {each.name}: its steps take no time, so every rate meets any "
                "SLO (it measures pdserve's own costs, not engines'): plan with a measured "
                "profile"
            )
    trace = trace or Trace.of(workload)
    longest = max(p + o for p, o in trace.lengths)
    if longest > shape.max_model_len:
        raise ValueError(
            f"workload {workload.name}: a request of {longest} tokens is longer than the "
            f"engines' max_model_len {shape.max_model_len}"
        )
    slo = workload.slo
    bounds = {width: work_bound(trace, each, num_engines // width) for width, each in sized.items()}
    results: list[CandidatePlan] = []
    for width in sorted(sized):
        for budget in tuple(chunk_budgets) or (None,):
            colocated, *splits = candidates(num_engines // width, width, budget)
            model = AppModel(
                colocated, sized[width], link, shape, slo.ttft_s, slo.tpot_s, slo.itl_s
            )
            base = _goodput(model, trace, attainment, bounds[width])
            results.append(base)
            for candidate in splits:
                if candidate.runs_as_colocated:  # adaptive 0:N: colocated's run, not run again
                    results.append(replace(base, candidate=candidate))
                else:
                    model = replace(model, candidate=candidate)
                    results.append(_goodput(model, trace, attainment, bounds[width]))
    return Plan(
        workload.name,
        profile.name,
        num_engines,
        slo.ttft_s,
        slo.tpot_s,
        attainment,
        tuple(results),
        min_gain,
        slo.itl_s,
        max(bounds.values()),
    )


def work_bound(trace: Trace, profile: SimProfile, num_engines: int) -> float:
    """Requests a second that `num_engines` engines of `profile` could finish of the trace's
    workload at most, in any topology and at any SLO: their seconds over the mean of each
    request's least compute (`SimProfile.request_seconds`, the shared prefix counted as
    cached). A finite modelled run can pass it by what is still queued when its arrivals end."""
    seconds = [
        profile.request_seconds(prompt, output, min(prompt, trace.shared_prefix_tokens))
        for prompt, output in trace.lengths
    ]
    mean = sum(seconds) / len(seconds)
    return math.inf if mean == 0 else num_engines / mean


def plan_for(config: AppConfig, workload: Workload | None = None) -> Plan:
    """The plan for an app: its `plan` section, its engines' shape and KV cache."""
    spec = config.plan
    sim = config.engine.sim
    profile = load_profile(spec.profile or (sim.profile if sim else DEFAULT_PROFILE))
    link = load_link(spec.link or (sim.link if sim and sim.link else profile.default_link))
    engine = config.engine
    shape = EngineShape(
        kv_cache_bytes=engine.kv_cache_memory_bytes,
        block_size=engine.block_size or 16,
        max_num_seqs=engine.max_num_seqs,
        max_model_len=engine.max_model_len,
        max_num_batched_tokens=engine.engine_kwargs.get("max_num_batched_tokens"),
    )
    workload = workload or load_workload(spec.workload)
    given = (("ttft_s", spec.ttft_s), ("tpot_s", spec.tpot_s), ("itl_s", spec.itl_s))
    slo = {k: v for k, v in given if v is not None}
    if slo:  # validated as the workload's own SLO is
        workload = workload.model_copy(
            update={"slo": WorkloadSLO.model_validate(workload.slo.model_dump() | slo)}
        )
    engines = spec.engines or config.prefill.num_replicas + config.decode.num_replicas
    trace = Trace.of(workload, seed=spec.seed)
    wider = {width: load_profile(name) for width, name in spec.wider_engines.items()}
    return plan(
        workload,
        profile,
        link,
        engines,
        shape,
        spec.attainment,
        trace,
        min_gain=spec.min_gain,
        wider=wider,
        chunk_budgets=spec.chunk_budgets,
    )


def resolve_auto(config: AppConfig) -> tuple[AppConfig, Plan | None]:
    """`topology: auto` made concrete by its plan: the topology, each pool's replicas at
    start (its autoscaling bounds widened to hold them) and `router.adaptive_prefill`. Any
    other topology is returned as it is, with no plan."""
    if config.topology != "auto":
        return config, None
    result = plan_for(config)
    best = result.best.candidate
    data = config.model_dump()
    if best.chunk_budget is not None:
        data["engine"]["engine_kwargs"]["max_num_batched_tokens"] = best.chunk_budget
    if best.runs_as_colocated:
        data["topology"] = "colocated"
        _start_with(data["colocated"], best.num_decode, best.width)
    else:
        data["topology"] = "disaggregated"
        _start_with(data["prefill"], best.num_prefill, best.width)
        _start_with(data["decode"], best.num_decode, best.width)
        data["router"]["adaptive_prefill"] = best.kind == "adaptive"
        if best.kind == "adaptive":
            data["router"]["local_prefill_max_tokens"] = 0
    return AppConfig.model_validate(data), result


def _start_with(pool: dict[str, Any], num_replicas: int, width: int) -> None:
    """The pool starts with `num_replicas`. The plan modelled each as an engine of its own, of
    `width` cores: on a pool with at least that many `cpu_cores` for each, each replica gets a
    slice of them (unless the config already says how many per replica), not every replica
    all of them. A width-1 plan of one engine keeps all the pool's cores (the default
    profile's engine; a plan that weighs wider engines says which it means)."""
    pool["num_replicas"] = num_replicas
    pool["min_replicas"] = min(pool["min_replicas"], num_replicas)
    pool["max_replicas"] = max(pool["max_replicas"], num_replicas)
    cores = pool.get("cpu_cores")
    if not cores or pool.get("cores_per_replica") is not None:
        return
    if width > 1 and num_replicas * width <= len(cores):
        pool["cores_per_replica"] = width
    elif width == 1 and 2 <= num_replicas <= len(cores):
        pool["cores_per_replica"] = len(cores) // num_replicas


def _goodput(
    model: AppModel, trace: Trace, attainment: float, ceiling: float = math.inf
) -> CandidatePlan:
    """The highest rate at which `attainment` holds, to about 2%: doubling up from the batch-1
    rate while it holds, quartering down while it does not, then bisection. A rate past
    `ceiling` (the work bound) fails unrun: a run of finite arrivals can meet loose SLOs
    there with a queue that a service receiving that rate would grow without end."""
    rate = model.rate_alone(trace)
    best: RunResult | None = None
    low, high = 0.0, math.inf
    for _ in range(40):
        result = model.run(trace, rate) if rate <= ceiling else None
        if result is not None and result.attainment >= attainment:
            best, low = result, rate
        else:
            high = rate
        if low > 0 and high < math.inf and high - low <= 0.02 * high:
            break
        if high == math.inf:
            rate *= 2
        elif low == 0:
            if rate < MIN_RATE:
                break
            rate /= 4
        else:
            rate = (low + high) / 2
    return CandidatePlan(model.candidate, low, best)


@dataclass
class _Req:
    index: int
    arrival: float
    prompt: tuple[int, ...]
    num_output: int
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_sent: int = 0  # tokens the client has
    local: bool = True
    scheduled_at: float | None = None  # its prompt's first step began
    handoff_at: float | None = None  # remote: its KV left the prefill engine
    kv_loaded_at: float | None = None  # remote: the decode engine's first (dropped) sample
    gaps: list[float] = field(default_factory=list)  # seconds between the client's tokens

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds between the tokens the client got; None below two."""
        if self.num_sent < 2:
            return None
        assert self.first_token_at is not None and self.last_token_at is not None
        return (self.last_token_at - self.first_token_at) / (self.num_sent - 1)

    @property
    def itl_s(self) -> float:
        return request_itl_s(self.gaps)


@dataclass(eq=False)
class _Engine:
    scheduler: SimScheduler
    step: Step | None = None
    step_end: float = 0.0
    owners: dict[str, _Req] = field(default_factory=dict)

    @property
    def pending_prefill_tokens(self) -> int:
        return sum(
            len(r.prompt_token_ids) - r.num_computed
            for r in (*self.scheduler.waiting, *self.scheduler.running)
            if r.num_computed < len(r.prompt_token_ids) and r.kv_transfer_s is None
        )


@dataclass(frozen=True)
class AppModel:
    """One candidate's app on a virtual clock."""

    candidate: Candidate
    profile: SimProfile
    link: Link
    shape: EngineShape
    ttft_slo_s: float
    tpot_slo_s: float
    itl_slo_s: float | None = None

    def rate_alone(self, trace: Trace) -> float:
        """Requests per second the engines finish one at a time each (no batching): where the
        search for the goodput starts."""
        seconds = [
            self.profile.step_seconds([(0, prompt)], [])
            + (output - 1) * self.profile.step_seconds([], [prompt + output // 2])
            for prompt, output in trace.lengths[: trace.min_requests]
        ]
        engines = self.candidate.num_prefill + self.candidate.num_decode
        return engines * len(seconds) / max(1e-9, sum(seconds))

    def run(self, trace: Trace, rate: float) -> RunResult:
        return _Run(self, trace, rate).result()

    @property
    def chunk_budget(self) -> int:
        """Every engine's chunked-prefill token budget."""
        return (
            self.candidate.chunk_budget
            or self.shape.max_num_batched_tokens
            or self.profile.max_num_batched_tokens
        )

    def new_engine(self) -> _Engine:
        shape = self.shape
        blocks = self.profile.num_blocks(shape.block_size, shape.kv_cache_bytes)
        return _Engine(
            SimScheduler(
                BlockPool(blocks, shape.block_size),
                _TOKENS,
                max_num_batched_tokens=self.chunk_budget,
                max_num_seqs=shape.max_num_seqs,
                max_model_len=shape.max_model_len,
            )
        )


class _Run:
    def __init__(self, model: AppModel, trace: Trace, rate: float) -> None:
        self.model = model
        self.rate = rate
        candidate = model.candidate
        self.prefill = [model.new_engine() for _ in range(candidate.num_prefill)]
        self.decode = [model.new_engine() for _ in range(candidate.num_decode)]
        self.decider = (
            PDDecider(
                model.tpot_slo_s,
                max_snapshot_age_s=math.inf,
                # Under an ITL SLO a local prompt's stall must fit in one gap's headroom.
                stall_budget="stream" if model.itl_slo_s is None else "token",
                itl_slo_s=model.itl_slo_s,
            )
            if candidate.kind == "adaptive"
            else None
        )
        prefix = tuple(range(trace.shared_prefix_tokens))
        self.requests = [
            _Req(
                i,
                trace.unit_arrivals[i] / rate,
                prefix
                + tuple(range(_UNIQUE_BASE * (i + 1), _UNIQUE_BASE * (i + 1) + p - len(prefix))),
                o,
            )
            for i, (p, o) in enumerate(trace.lengths[: trace.num_requests(rate)])
        ]
        self.deadline = self.requests[-1].arrival + _MAX_SECONDS_AFTER_LAST
        self.now = 0.0
        self._wakes: list[float] = []  # when a transfer lands on an idle engine

    def result(self) -> RunResult:
        self._simulate()
        model = self.model
        met = 0
        ttfts, tpots, itls = [], [], []
        for r in self.requests:
            if r.num_sent < r.num_output:
                ttfts.append(math.inf)
                tpots.append(math.inf)
                itls.append(math.inf)
                continue
            assert r.first_token_at is not None
            ttft = r.first_token_at - r.arrival
            tpot = r.tpot_s or 0.0  # one token: no gap
            ttfts.append(ttft)
            tpots.append(tpot)
            itls.append(r.itl_s)
            met += (
                ttft <= model.ttft_slo_s
                and tpot <= model.tpot_slo_s
                and (model.itl_slo_s is None or r.itl_s <= model.itl_slo_s)
            )
        num_local = sum(r.local for r in self.requests)
        return RunResult(
            self.rate,
            met / len(self.requests),
            nearest_rank(ttfts, 0.9),
            nearest_rank(tpots, 0.9),
            nearest_rank(itls, 0.9),
            num_local,
            len(self.requests) - num_local,
            self._local_stall_s(),
        )

    def _local_stall_s(self) -> float | None:
        budget = self.model.chunk_budget
        computes = [
            step_seconds(r.first_token_at - r.scheduled_at, len(r.prompt), budget)
            for r in self.requests
            if r.local and r.first_token_at is not None and r.scheduled_at is not None
        ]
        tpots = [t for t in (r.tpot_s for r in self.requests) if t is not None]
        if not computes:
            return None
        return Stalls(tpot_median_s=percentile(tpots, 50)).added_s(percentile_of(computes, 95))

    def _engines(self) -> Iterator[_Engine]:
        yield from self.prefill
        yield from self.decode

    def _simulate(self) -> None:
        arrivals = iter(self.requests)
        upcoming = next(arrivals, None)
        while True:
            busy = [e for e in self._engines() if e.step is not None]
            step_end = min((e.step_end for e in busy), default=math.inf)
            wake = self._wakes[0] if self._wakes else math.inf
            arrival = upcoming.arrival if upcoming is not None else math.inf
            now = min(step_end, wake, arrival)
            if now == math.inf or now > self.deadline:
                return
            self.now = now
            if arrival == now and upcoming is not None:
                self._arrive(upcoming)
                upcoming = next(arrivals, None)
            elif step_end == now:
                for engine in busy:
                    if engine.step_end == now:
                        self._complete(engine)
            else:
                heapq.heappop(self._wakes)
            for engine in self._engines():
                if engine.step is None:
                    self._start(engine)

    def _start(self, engine: _Engine) -> None:
        scheduler = engine.scheduler
        if not scheduler.num_unfinished:
            return
        step = scheduler.schedule(self.now)
        if not step.chunks:
            ready_at = scheduler.next_kv_ready_at()
            if ready_at is not None and ready_at > self.now:
                heapq.heappush(self._wakes, ready_at)
            return
        for chunk in step.chunks:
            owner = engine.owners[chunk.request.request_id]
            if not chunk.is_decode and owner.scheduled_at is None:
                owner.scheduled_at = self.now
        engine.step = step
        engine.step_end = self.now + self.model.profile.step_seconds(
            step.prefill_chunks, step.decode_contexts
        )

    def _complete(self, engine: _Engine) -> None:
        step, engine.step = engine.step, None
        assert step is not None
        for sampled in engine.scheduler.complete(step):
            request = sampled.request
            owner = engine.owners[request.request_id]
            if request.kv_transfer_s is not None and len(request.output_token_ids) == 1:
                owner.kv_loaded_at = self.now  # the prefill engine's token, sampled again
            elif engine in self.prefill:
                self._token(owner)
                self._hand_off(owner)
            else:
                self._token(owner)
            if sampled.finish_reason is not None:
                del engine.owners[request.request_id]
                if engine in self.decode:
                    self._observe(owner)

    def _token(self, owner: _Req) -> None:
        owner.num_sent += 1
        if owner.last_token_at is not None:
            owner.gaps.append(self.now - owner.last_token_at)
        owner.last_token_at = self.now
        if owner.first_token_at is None:
            owner.first_token_at = self.now

    def _arrive(self, owner: _Req) -> None:
        decode = self._least_loaded(self.decode)
        local = self.model.candidate.kind == "colocated"
        if self.decider is not None:
            prefill = self._least_loaded(self.prefill) if self.prefill else None
            inputs = PDInputs(
                len(owner.prompt),
                0,
                None if prefill is None else PoolSnapshot(prefill.pending_prefill_tokens, 0, 0.0),
                PoolSnapshot(decode.pending_prefill_tokens, len(decode.scheduler.running), 0.0),
                no_prefill_engine=prefill is None,
            )
            local = self.decider.decide(inputs).path == "local"
        owner.local = local
        if local:
            self._add(decode, owner, owner.num_output, None)
        else:
            self._add(self._least_loaded(self.prefill), owner, 1, None)

    def _hand_off(self, owner: _Req) -> None:
        owner.handoff_at = self.now
        if owner.num_output == 1:
            self._observe(owner)
            return
        transfer = self.model.link.transfer_seconds(
            len(owner.prompt) * self.model.profile.kv_bytes_per_token
        )
        # The decode engine samples the prefill engine's token again, then the rest.
        self._add(self._least_loaded(self.decode), owner, owner.num_output, transfer)

    def _add(self, engine: _Engine, owner: _Req, max_tokens: int, transfer: float | None) -> None:
        request_id = f"{owner.index}-{'d' if engine in self.decode else 'p'}"
        request = SimRequest(request_id, owner.prompt, max_tokens, owner.index, transfer)
        engine.scheduler.add(request)
        engine.owners[request_id] = owner

    def _least_loaded(self, engines: list[_Engine]) -> _Engine:
        return min(
            engines,
            key=lambda e: (e.pending_prefill_tokens, len(e.scheduler.running), id(e)),
        )

    def _observe(self, owner: _Req) -> None:
        if self.decider is None:
            return
        assert owner.first_token_at is not None
        start = owner.scheduled_at if owner.scheduled_at is not None else owner.arrival
        prefill_s = owner.first_token_at - start
        kv_transfer_s = None
        if not owner.local and owner.kv_loaded_at is not None and owner.handoff_at is not None:
            kv_transfer_s = owner.kv_loaded_at - owner.handoff_at
        self.decider.observe(
            len(owner.prompt), prefill_s, kv_transfer_s, owner.tpot_s, owner.num_sent
        )
