"""Flip first, start second: a pool's scale decision turned into a role flip where one can do
(router/roles.py has the flips; pure here, the policy shell applies them).

A replica start costs minutes (a model load), a flip a tenth of a second, so when a pool
decides to grow:
  1. recall: one of its own replicas that is lent to the other pool comes back;
  2. borrow: else, when the other pool's latest decision (fresh) is calm (it could do with one
     replica fewer: "hold: calm ..." while its down delay runs, or "down: ...") and it has two
     or more replicas serving its own calls, the last of them is lent to this pool;
and the pool holds its replica count this tick (the flip is the capacity change). Only when
neither can do does the scale-up start replicas. A pool that decides to shrink while one of
its replicas is lent holds instead: the lent replica is the spare it would have removed, and
Serve could otherwise pick that very replica to stop.

Hysteresis: a pool flips at most once per `min_interval_s`; a lender holds while its replica
is out, so a borrow is not undone by the lender's next scale-down; its recall is a scale-up,
held by its up cool-down like any other.

The split follows the work (`plan_split`): between scale events, the engines serving each role
track the measured prefill share of the work. Every engine reports both its prefill busy time
and its decode load; in replicas' worth at the policy's targets (`Work`), the prefill share s of
N engines asks for N x s of them serving prefill (at least one of each). A pool short of its
share by a whole replica or more takes one by a flip: its own lent replica back first, else the
other pool's last one serving the other role, when the other role keeps two or more and stays
within its target with one fewer. A whole replica, not a rounding, is the hysteresis: after the
flip the other side is short by less than one, so it does not flip back at the same work.

With `min_prefill_engines` 0 (an adaptive router, which prefills every prompt on its decode
engine when no engine serves prefill) the split can lend the last prefill engine too, and take
one back, by what a prompt computed locally adds to the gap its engine's streams wait
(`Stalls`: its compute per chunked-prefill step less their median TPOT), against a limit
(the ITL SLO where the router has one, else the TPOT SLO): the router's one-token stall rule
(router/pd_decision.py), read from the engines' windows.
  - The decode pool takes the last prefill engine when the prompts it computes would add at
    most the limit (or it computed none, near idle) and the local ones add at most
    `RELEASE_MARGIN` of it:
    every prompt is then computed locally, colocated serving on every engine.
  - The prefill pool takes one back (its own lent engine first) when the local prompts add
    more than the limit: prompts long enough to stall the streams past their SLO are about,
    which a prefill engine takes off them.
Between that margin and the limit for the local prompts nothing flips, the hysteresis (and
at most one flip per interval either way).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from autoscaling.config import AutoscalingConfig
from control.records import DecisionRecord, RoleTable
from engine.autoscaling_stats import (
    BUSY_FRACTION,
    KV_CACHE_USAGE,
    LOCAL_PREFILL_STEP_P95_S,
    NO_SAMPLE,
    PREFILL_STEP_P95_S,
    TPOT_P50_S,
    TPOT_P95_S,
)

OTHER_POOL = {"prefill": "decode", "decode": "prefill"}


@dataclass(frozen=True)
class RoleChange:
    """What the policy does instead of its decision: flip `replica` to `role` (None: hold the
    count with no flip), keeping the pool at `target_replicas`, for `reason`."""

    target_replicas: int
    reason: str
    replica: str | None = None
    role: str | None = None


def is_spare(decision: DecisionRecord) -> bool:
    """Whether a pool's decision says it could do with one replica fewer (autoscaling/policy.py:
    calm pools hold while their down delay runs, then scale down)."""
    return decision.target_replicas < decision.current_replicas or decision.reason.startswith(
        "hold: calm"
    )


def plan_role_change(
    pool: str,
    current_replicas: int,
    target_replicas: int,
    table: RoleTable,
    replicas: Mapping[str, Sequence[str]],
    other_last: DecisionRecord | None,
    now_s: float,
    last_flip_s: float | None,
    min_interval_s: float,
    max_decision_age_s: float,
) -> RoleChange | None:
    """The flip (or hold) that replaces `pool`'s decision current -> target, or None to keep
    the decision. `replicas`: each pool's live worker ids (published loads)."""
    other = OTHER_POOL[pool]
    own = sorted(replicas.get(pool, ()))
    lent = [w for w in own if table.role_of(w) != pool]
    if target_replicas < current_replicas:
        if not lent:
            return None
        return RoleChange(
            current_replicas,
            f"holds {current_replicas}: {', '.join(lent)} lent to {other} is the spare",
        )
    if target_replicas <= current_replicas:
        return None
    if last_flip_s is not None and now_s - last_flip_s < min_interval_s:
        return None
    if lent:
        return RoleChange(
            current_replicas,
            f"recalls {lent[0]} from {other} (a flip, not a replica start)",
            lent[0],
            pool,
        )
    if other_last is None or now_s - other_last.at > max_decision_age_s:
        return None
    if not is_spare(other_last):
        return None
    spare = [w for w in sorted(replicas.get(other, ())) if table.role_of(w) == other]
    if len(spare) < 2:  # never the other pool's last replica serving its own calls
        return None
    return RoleChange(
        current_replicas,
        f"borrows {spare[-1]} from {other}, which would scale down (a flip, not a replica start)",
        spare[-1],
        pool,
    )


WORK_INPUTS = ("work_prefill", "work_decode")  # their names in a pool's DecisionRecord inputs


class Work(NamedTuple):
    """Work in replicas' worth at the policy's targets: prefill, busy time over
    `target_utilization` (prompts computed for other engines); decode, the larger of TPOT P95
    over `slo_headroom` x the TPOT SLO and KV usage over `kv_usage_target` (what the decode
    policy scales on, linear in load)."""

    prefill: float = 0.0
    decode: float = 0.0

    def __add__(self, other: object) -> Work:
        if not isinstance(other, Work):
            return NotImplemented
        return Work(self.prefill + other.prefill, self.decode + other.decode)

    def as_inputs(self) -> dict[str, float]:
        """As a DecisionRecord's inputs hold it (`work_from_inputs` reads it back)."""
        return dict(zip(WORK_INPUTS, self, strict=True))

    @property
    def prefill_share(self) -> float | None:
        total = self.prefill + self.decode
        return self.prefill / total if total > 0 else None


# Their names in a pool's DecisionRecord inputs (absent: no sample).
STALL_INPUTS = ("stall_local_step_s", "stall_remote_step_s", "stall_tpot_median_s")
# The split lends the last prefill engine only while local prompts stall a gap by at most this
# share of the limit; it takes one back past the whole limit.
RELEASE_MARGIN = 0.8


class Stalls(NamedTuple):
    """What a prompt computed beside running streams costs them, from the engines' windows:
    the largest over engines of the configured percentile of a prompt's compute per
    chunked-prefill step, of prompts computed locally (`local_s`) and of those computed for
    other engines (`remote_s`), and
    the smallest of their median TPOTs (`tpot_median_s`, the gap the streams take anyway;
    the smallest, so an added stall is not understated). None: no sample."""

    local_s: float | None = None
    remote_s: float | None = None
    tpot_median_s: float | None = None

    def __or__(self, other: object) -> Stalls:
        if not isinstance(other, Stalls):
            return NotImplemented
        return Stalls(
            _merged(max, self.local_s, other.local_s),
            _merged(max, self.remote_s, other.remote_s),
            _merged(min, self.tpot_median_s, other.tpot_median_s),
        )

    def added_s(self, compute_s: float | None) -> float | None:
        """What a prompt step of `compute_s` adds to its engine's gap; None with no sample."""
        if compute_s is None:
            return None
        return max(0.0, compute_s - (self.tpot_median_s or 0.0))

    def as_inputs(self) -> dict[str, float]:
        """As a DecisionRecord's inputs hold it (`stalls_from_inputs` reads it back)."""
        return {name: v for name, v in zip(STALL_INPUTS, self, strict=True) if v is not None}


def _merged(
    pick: Callable[[float, float], float], a: float | None, b: float | None
) -> float | None:
    if a is None or b is None:
        return a if b is None else b
    return pick(a, b)


def replica_stalls(metrics: Mapping[str, float]) -> Stalls:
    """One engine's stall signals from its autoscaling metrics (decode_workers/deployment.py);
    a missing or "no sample" value is None."""

    def sample(key: str) -> float | None:
        number = metrics.get(key, NO_SAMPLE)
        ok = isinstance(number, int | float) and math.isfinite(number) and number >= 0
        return float(number) if ok else None

    return Stalls(sample(LOCAL_PREFILL_STEP_P95_S), sample(PREFILL_STEP_P95_S), sample(TPOT_P50_S))


def pool_stalls(metrics: Iterable[Mapping[str, float]]) -> Stalls:
    return functools.reduce(operator.or_, (replica_stalls(m) for m in metrics), Stalls())


def stalls_from_inputs(inputs: Mapping[str, float]) -> Stalls:
    return Stalls(*(inputs.get(name) for name in STALL_INPUTS))


def replica_work(
    metrics: Mapping[str, float], tpot_slo_s: float, config: AutoscalingConfig
) -> Work:
    """One engine's work from its autoscaling metrics (decode_workers/deployment.py reports
    both windows; a missing or "no sample" value counts as none)."""

    def value(key: str) -> float:
        number = metrics.get(key, 0.0)
        return number if isinstance(number, int | float) and math.isfinite(number) else 0.0

    busy = min(max(value(BUSY_FRACTION), 0.0), 1.0)
    tpot_s = max(value(TPOT_P95_S), 0.0)
    kv = min(max(value(KV_CACHE_USAGE), 0.0), 1.0)
    return Work(
        busy / config.target_utilization,
        max(tpot_s / (config.slo_headroom * tpot_slo_s), kv / config.kv_usage_target),
    )


def pool_work(
    metrics: Iterable[Mapping[str, float]], tpot_slo_s: float, config: AutoscalingConfig
) -> Work:
    return sum((replica_work(m, tpot_slo_s, config) for m in metrics), Work())


def work_from_inputs(inputs: Mapping[str, float]) -> Work | None:
    """A pool's work as its DecisionRecord holds it; None when the record has none."""
    if not all(name in inputs for name in WORK_INPUTS):
        return None
    return Work(*(inputs[name] for name in WORK_INPUTS))


def plan_split(
    pool: str,
    current_replicas: int,
    work: Work,
    table: RoleTable,
    replicas: Mapping[str, Sequence[str]],
    now_s: float,
    last_flip_s: float | None,
    min_interval_s: float,
    min_load: float,
    min_prefill_engines: int = 1,
    stalls: Stalls | None = None,
    stall_limit_s: float = math.inf,
) -> RoleChange | None:
    """The flip that moves one engine to `pool`'s role when the app's `work` asks for a whole
    replica more of it there (the pool keeps `current_replicas`); None to leave the split.
    `replicas`: each pool's live worker ids; `min_load`: below this work per engine serving its
    role, a pool takes none (near idle, the share is noise). `min_prefill_engines` 0 lets the
    split lend the last prefill engine and take one back, by the app's `stalls` against
    `stall_limit_s` (the module's doc)."""
    if min_prefill_engines not in (0, 1):
        raise ValueError(f"min_prefill_engines must be 0 or 1, got {min_prefill_engines}")
    if last_flip_s is not None and now_s - last_flip_s < min_interval_s:
        return None
    other = OTHER_POOL[pool]
    live = {pool_name: sorted(ids) for pool_name, ids in replicas.items()}
    engines = [w for ids in live.values() for w in ids]
    serving = {role: sum(table.role_of(w) == role for w in engines) for role in OTHER_POOL}
    total = len(engines)
    if total < 2:
        return None
    if min_prefill_engines == 0:
        why = _all_local_or_back(pool, work, stalls or Stalls(), stall_limit_s, serving, min_load)
        if why is not None:
            return _flip_one(pool, current_replicas, why, table, live)
    share = work.prefill_share
    if share is None or serving[pool] == 0 or serving[other] < 2:
        return None
    own_share = share if pool == "prefill" else 1.0 - share
    wanted = min(max(total * own_share, 1.0), total - 1.0)
    own_work = work.prefill if pool == "prefill" else work.decode
    other_work = work.decode if pool == "prefill" else work.prefill
    if wanted - serving[pool] < 1.0 or own_work / serving[pool] < min_load:
        return None
    if other_work / (serving[other] - 1) > 1.0:
        return None  # one engine fewer would put the other role over its target
    why = (
        f"split: prefill share {share:.2f} of the work asks for {wanted:.1f} of {total} engines "
        f"serving {pool}, {serving[pool]} do"
    )
    return _flip_one(pool, current_replicas, why, table, live)


def _all_local_or_back(
    pool: str,
    work: Work,
    stalls: Stalls,
    limit_s: float,
    serving: Mapping[str, int],
    min_load: float,
) -> str | None:
    """Why `pool` takes an engine across the no-prefill-engine line (the module's doc), or
    None: the decode pool lends the last prefill engine to decoding, the prefill pool takes
    one back."""
    local = stalls.added_s(stalls.local_s)
    if pool == "decode" and serving["prefill"] == 1 and serving["decode"] >= 1:
        remote = stalls.added_s(stalls.remote_s)
        if work.decode / serving["decode"] < min_load:
            return None  # near idle: one more decoding engine gains nothing
        if remote is None and work.prefill >= min_load:
            return None  # busy, yet no prompt timed: no evidence its prompts are short
        release_s = RELEASE_MARGIN * limit_s
        if (remote is not None and remote > limit_s) or (local is not None and local > release_s):
            return None
        return (
            f"split: a prompt computed locally would add {_ms(remote)} (the prefill engine's) "
            f"and {_ms(local)} (the local ones) to a gap, within {_ms(limit_s)} "
            f"({_ms(release_s)} for the local ones): every prompt local"
        )
    if pool == "prefill" and serving["prefill"] == 0 and serving["decode"] >= 2:
        if local is None or local <= limit_s:
            return None
        return (
            f"split: no engine serves prefill and local prompts add {_ms(local)} to a gap, "
            f"past {_ms(limit_s)}"
        )
    return None


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1000:.0f} ms"


def _flip_one(
    pool: str,
    current_replicas: int,
    why: str,
    table: RoleTable,
    live: Mapping[str, Sequence[str]],
) -> RoleChange:
    """One engine to `pool`'s role: its own lent engine back first, else the other pool's last
    one serving the other role."""
    other = OTHER_POOL[pool]
    lent = [w for w in live.get(pool, ()) if table.role_of(w) != pool]
    if lent:
        return RoleChange(current_replicas, f"{why}: recalls {lent[0]}", lent[0], pool)
    taken = [w for w in live.get(other, ()) if table.role_of(w) == other][-1]
    return RoleChange(current_replicas, f"{why}: borrows {taken} from {other}", taken, pool)
