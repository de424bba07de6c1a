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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from control.records import DecisionRecord, RoleTable

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
