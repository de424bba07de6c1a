"""Ray Serve custom autoscaling policies for the two pools: the shell around `decide_prefill` /
`decide_decode`, with SLO, bounds and pin read from Redis and each decision logged there.

How Serve 2.60 runs a class policy (paths under ray/serve/):
- `_private/autoscaling_state.py:62-76` `_resolve_policy_callable`: when `policy_function`
  names a class, the controller builds one instance with `**policy_kwargs` (JSON-able) each
  time the deployment is (re)deployed (`:383-399`, which also resets `policy_state` to {}).
- `:666-698` `get_decision_num_replicas`: every control-loop pass (~0.1 s) it calls
  `instance(ctx) -> (num_replicas, policy_state)`; the next `ctx.policy_state` is a copy of
  the returned dict (`:704-723`), with Serve's delay keys merged in.
- `autoscaling_policy.py:235-262` wraps the call: zero running replicas with requests waiting
  skip the policy (cold start); then up/downscaling factors, `upscale_delay_s` /
  `downscale_delay_s` (0 from `autoscaling_config_for`: the policy has its own cool-downs) and
  `min_replicas` / `max_replicas` (`apply_bounds`, `:466`) apply to what it returns.

Per call: the latest metric dict of each running replica -> replica reports -> pool signals
-> decision, with `ScalingHistory` kept in the policy state. The decision is logged to Redis
when it scales or its kind of reason changes (`reason_kind`), not every tick. Nothing may raise
into the controller: an unexpected error keeps the current target and is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from autoscaling.config import DEFAULT_CONFIG, DEFAULT_SLO, AutoscalingConfig
from autoscaling.control_reader import ControlReader, ControlSettings, RolesSnapshot
from autoscaling.history import ScalingHistory
from autoscaling.policy import Decision, decide_decode, decide_prefill
from autoscaling.roles import (
    RoleChange,
    Stalls,
    Work,
    plan_role_change,
    plan_split,
    pool_stalls,
    pool_work,
    stalls_from_inputs,
    work_from_inputs,
)
from autoscaling.serve_metrics import (
    decision_inputs,
    decode_report_from_metrics,
    history_from_state,
    history_to_state,
    latest_replica_metrics,
    prefill_report_from_metrics,
    reason_kind,
)
from autoscaling.signals import aggregate_decode, aggregate_prefill
from control.keys import validate_pool
from control.records import DecisionRecord, PoolSLO, ReplicaBounds
from engine.autoscaling_stats import DECODE_METRIC_KEYS, PREFILL_METRIC_KEYS

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

# A child of Serve's logger, so the lines land in the controller's log.
logger = logging.getLogger("ray.serve.pdserve")

HISTORY_STATE_KEY = "pdserve_history"
LOGGED_KIND_STATE_KEY = "pdserve_logged_reason_kind"
LAST_FLIP_STATE_KEY = "pdserve_last_flip_s"

ReportT = TypeVar("ReportT")
SignalsT = TypeVar("SignalsT")


@dataclass(frozen=True)
class PoolFunctions(Generic[ReportT, SignalsT]):
    """What differs between the pools: metric keys, report parser, aggregation, decision."""

    metric_keys: tuple[str, ...]
    parse: Callable[[Mapping[str, float]], ReportT]
    aggregate: Callable[[Sequence[ReportT], float, int], SignalsT]
    decide: Callable[
        [SignalsT, PoolSLO, ReplicaBounds, int | None, ScalingHistory, float, AutoscalingConfig],
        Decision,
    ]


PREFILL = PoolFunctions(
    PREFILL_METRIC_KEYS, prefill_report_from_metrics, aggregate_prefill, decide_prefill
)
DECODE = PoolFunctions(
    DECODE_METRIC_KEYS, decode_report_from_metrics, aggregate_decode, decide_decode
)


class PoolAutoscaler:
    """The shared shell of `PrefillAutoscaler` and `DecodeAutoscaler`.

    `config` holds `AutoscalingConfig` fields (percentile, window_s, tick_s, thresholds);
    `min_replicas` / `max_replicas` and the default SLO apply until Redis holds others.
    """

    pool: ClassVar[str]
    functions: ClassVar[PoolFunctions[Any, Any]]

    def __init__(
        self,
        app: str,
        redis_url: str | None = None,
        *,
        redis_url_env: str | None = None,
        min_replicas: int = 1,
        max_replicas: int = 64,
        default_ttft_p95_s: float = DEFAULT_SLO.ttft_p95_s,
        default_tpot_p95_s: float = DEFAULT_SLO.tpot_p95_s,
        config: Mapping[str, Any] | None = None,
        control_refresh_s: float = 1.0,
        redis_timeout_s: float = 0.2,
    ) -> None:
        self.app = app
        self.config = AutoscalingConfig(**(config or {}))
        defaults = ControlSettings(
            PoolSLO(default_ttft_p95_s, default_tpot_p95_s),
            ReplicaBounds(min_replicas, max_replicas),
        )
        self.control = ControlReader(
            redis_url, app, self.pool, defaults, control_refresh_s, redis_timeout_s, redis_url_env
        )
        self._last_control_error: str | None = None
        self._refresh_s = control_refresh_s
        self._roles_read: tuple[float, RolesSnapshot | None] | None = None

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        try:
            return self._step(ctx)
        except Exception:
            logger.exception("pdserve %s autoscaler failed; keeping the current target", self.pool)
            return ctx.target_num_replicas, dict(ctx.policy_state)

    def _step(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        state = dict(ctx.policy_state)
        control = self.control.read(now_s)
        if control.error != self._last_control_error:
            self._last_control_error = control.error
            if control.error is not None:  # Once per outage, not every tick.
                logger.warning("pdserve %s autoscaler: %s", self.pool, control.error)
        latest = latest_replica_metrics(ctx.aggregated_metrics, ctx.raw_metrics)
        reports = self._reports(latest.values())
        target = ctx.target_num_replicas
        if len(reports) > target:
            # Serve is still stopping replicas after a scale-down: their reports are stale.
            return target, state
        bounds = _within(
            control.bounds, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        )
        # Replicas that have not reported yet count as starting: present, but no signal.
        signals = self.functions.aggregate(reports, self.config.percentile, target - len(reports))
        decision: Decision = self.functions.decide(
            signals, control.slo, bounds, control.pin, _history(state), now_s, self.config
        )
        # Every engine reports both windows: this pool's share of the app's work, for the split.
        work = pool_work(latest.values(), control.slo.tpot_p95_s, self.config)
        stalls = pool_stalls(latest.values())
        if self.config.flip_first and control.pin is None:
            if decision.is_scale_event:
                decision = self._flip_first(decision, state, now_s)
            # A scale event the flips turned into a hold (a pool whose lent engine is its
            # spare) still follows the work: at no prefill engine that pool would shrink.
            if not decision.is_scale_event and self.config.split_follows_work:
                decision = self._follow_work(
                    decision, work, stalls, control.slo.tpot_p95_s, state, now_s
                )
        reason = (
            decision.reason if control.error is None else f"{decision.reason} [{control.error}]"
        )
        kind = reason_kind(reason)
        record = DecisionRecord(
            now_s,
            self.pool,
            decision.current_replicas,
            decision.target_replicas,
            reason,
            decision_inputs(decision, control.slo, control.pin)
            | work.as_inputs()
            | stalls.as_inputs(),
        )
        # Every tick's decision is kept as the latest; the log gets scale events and changes
        # of reason only, so a steady pool does not flood it.
        logged = decision.is_scale_event or kind != state.get(LOGGED_KIND_STATE_KEY)
        if self.control.append(record, logged=logged) and logged:
            state[LOGGED_KIND_STATE_KEY] = kind
        if decision.is_scale_event:
            logger.info(
                "pdserve %s autoscaler: %d -> %d replicas: %s",
                self.pool,
                decision.current_replicas,
                decision.target_replicas,
                reason,
            )
        state[HISTORY_STATE_KEY] = history_to_state(decision.history)
        return decision.target_replicas, state

    def _flip_first(self, decision: Decision, state: dict[str, Any], now_s: float) -> Decision:
        """The decision, or the role flip (or hold) that replaces it (autoscaling/roles.py)."""
        roles = self._roles(now_s)
        if roles is None:
            return decision
        change = plan_role_change(
            self.pool,
            decision.current_replicas,
            decision.target_replicas,
            roles.table,
            roles.replicas,
            roles.other_last,
            now_s,
            state.get(LAST_FLIP_STATE_KEY),
            min_interval_s=self._flip_interval_s,
            max_decision_age_s=self._max_decision_age_s,
        )
        if change is None or not self._flipped(change, state, now_s):
            return decision
        return decision._replace(
            target_replicas=change.target_replicas,
            reason=f"{change.reason}; instead of {decision.current_replicas} -> "
            f"{decision.target_replicas} ({decision.reason})",
        )

    def _follow_work(
        self,
        decision: Decision,
        work: Work,
        stalls: Stalls,
        tpot_slo_s: float,
        state: dict[str, Any],
        now_s: float,
    ) -> Decision:
        """The decision, with the flip that moves one engine to this pool's role when the
        app's measured prefill share asks for it, or (with `split_min_prefill_engines` 0) its
        prompts' stalls against the limit do: `split_stall_limit_s` (the router's ITL SLO),
        else the TPOT SLO (autoscaling/roles.py `plan_split`)."""
        roles = self._roles(now_s)
        if roles is None or roles.other_last is None:
            return decision
        if now_s - roles.other_last.at > self._max_decision_age_s:
            return decision
        other_work = work_from_inputs(roles.other_last.inputs)
        if other_work is None:
            return decision
        change = plan_split(
            self.pool,
            decision.target_replicas,
            work + other_work,
            roles.table,
            roles.replicas,
            now_s,
            state.get(LAST_FLIP_STATE_KEY),
            min_interval_s=self._flip_interval_s,
            min_load=self.config.downscale_utilization,
            min_prefill_engines=self.config.split_min_prefill_engines,
            stalls=stalls | stalls_from_inputs(roles.other_last.inputs),
            stall_limit_s=self.config.split_stall_limit_s or tpot_slo_s,
        )
        if change is None or change.replica is None or not self._flipped(change, state, now_s):
            return decision
        return decision._replace(reason=f"{change.reason}; {decision.reason}")

    @property
    def _flip_interval_s(self) -> float:
        return self.config.flip_interval_ticks * self.config.tick_s

    @property
    def _max_decision_age_s(self) -> float:
        """The other pool's decision older than this is not acted on (3 ticks: it stopped)."""
        return 3 * self.config.tick_s

    def _flipped(self, change: RoleChange, state: dict[str, Any], now_s: float) -> bool:
        """Apply `change`'s flip, if it names one; False when writing it failed (then the
        decision stands as it was)."""
        if change.replica is None or change.role is None:
            return True  # a hold, no flip
        if not self.control.flip(change.replica, change.role):
            return False
        state[LAST_FLIP_STATE_KEY] = now_s
        self._roles_read = None  # changed: read again next time
        return True

    def _roles(self, now_s: float) -> RolesSnapshot | None:
        """The roles as last read, at most `control_refresh_s` old (a pool that holds for a
        lent replica decides so every controller pass)."""
        if self._roles_read is None or now_s - self._roles_read[0] >= self._refresh_s:
            # Replicas publish their loads every routing-stats period: 3 ticks is long dead.
            self._roles_read = (now_s, self.control.roles(replica_age_s=3 * self.config.tick_s))
        return self._roles_read[1]

    def _reports(self, metrics: Iterable[Mapping[str, float]]) -> list[Any]:
        """Reports of the replicas that pushed a complete, valid metric dict."""
        reports = []
        for replica_metrics in metrics:
            if not all(key in replica_metrics for key in self.functions.metric_keys):
                continue  # Started, has not run record_autoscaling_stats yet.
            try:
                reports.append(self.functions.parse(replica_metrics))
            except ValueError as error:
                logger.debug("pdserve %s autoscaler: ignoring a report: %s", self.pool, error)
        return reports


class PrefillAutoscaler(PoolAutoscaler):
    pool = "prefill"
    functions = PREFILL


class DecodeAutoscaler(PoolAutoscaler):
    pool = "decode"
    functions = DECODE


def autoscaling_config_for(
    pool: str,
    app: str,
    redis_url: str | None,
    min_replicas: int,
    max_replicas: int,
    initial_replicas: int | None = None,
    *,
    slo: PoolSLO = DEFAULT_SLO,
    config: AutoscalingConfig = DEFAULT_CONFIG,
    redis_url_env: str | None = None,
) -> dict[str, Any]:
    """`autoscaling_config` for `serve.deployment(...).options(...)` of one pool.

    Serve logs `policy_kwargs` at INFO when it builds the policy, so a `redis_url` with a
    password lands in the controller's log: prefer `redis_url_env`, the name of a variable set
    in the Ray head's environment (the controller inherits it).

    Replicas call `record_autoscaling_stats` every `min(0.2 x look_back_period_s,
    metrics_interval_s)` and push to the controller every `metrics_interval_s`
    (ray/serve/_private/replica.py:689-711; in 2.60 RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH
    _INTERVAL_S is only named in a deprecation warning). Both follow `config.tick_s`; a
    tick_s other than 10 s makes Serve warn that metrics_interval_s is deprecated.
    """
    validate_pool(pool)
    ReplicaBounds(min_replicas, max_replicas)  # Fail here, not in the controller.
    if redis_url is not None and redis_url_env is not None:
        raise ValueError("give redis_url or redis_url_env, not both")
    policy_class = PrefillAutoscaler if pool == "prefill" else DecodeAutoscaler
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "initial_replicas": initial_replicas,
        # The policy holds its own cool-downs and calm timers; Serve's delays would add to them.
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "metrics_interval_s": config.tick_s,
        # Must exceed metrics_interval_s; records every 0.4 tick, only the latest point is read.
        "look_back_period_s": 2 * config.tick_s,
        "policy": {
            "policy_function": f"{__name__}:{policy_class.__name__}",
            "policy_kwargs": {
                "app": app,
                "redis_url": redis_url,
                "redis_url_env": redis_url_env,
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "default_ttft_p95_s": slo.ttft_p95_s,
                "default_tpot_p95_s": slo.tpot_p95_s,
                "config": asdict(config),
            },
        },
    }


def _history(state: Mapping[str, Any]) -> ScalingHistory:
    try:
        return history_from_state(state.get(HISTORY_STATE_KEY))
    except ValueError as error:
        logger.warning("pdserve autoscaler: dropping malformed history state: %s", error)
        return ScalingHistory()


def _within(bounds: ReplicaBounds, hard_min: int, hard_max: int) -> ReplicaBounds:
    """The operator's bounds inside Serve's (capacity-adjusted) min/max, which Serve enforces
    after the policy anyway: clamping here keeps the decision's reason true."""
    low = max(hard_min, min(bounds.min_replicas, hard_max))
    high = max(low, min(bounds.max_replicas, hard_max), 1)
    return ReplicaBounds(low, high)
