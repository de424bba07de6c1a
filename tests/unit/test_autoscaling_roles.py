"""Flip first, start second (autoscaling/roles.py): which flip, if any, replaces a pool's
scale decision."""

from __future__ import annotations

from autoscaling.roles import plan_role_change
from control.records import DecisionRecord, RoleTable

NOW = 1_700_000_000.0
REPLICAS = {"prefill": ["prefill-p1"], "decode": ["decode-d1", "decode-d2"]}


def decision(
    pool: str, current: int, target: int, age_s: float = 1.0, reason: str = "why"
) -> DecisionRecord:
    return DecisionRecord(NOW - age_s, pool, current, target, reason, {})


def plan(pool: str, current: int, target: int, **kw: object):  # type: ignore[no-untyped-def]
    args = {
        "table": RoleTable(),
        "replicas": REPLICAS,
        "other_last": None,
        "now_s": NOW,
        "last_flip_s": None,
        "min_interval_s": 30.0,
        "max_decision_age_s": 30.0,
    } | kw
    return plan_role_change(pool, current, target, **args)  # type: ignore[arg-type]


def test_a_pool_that_grows_borrows_from_one_that_is_calm() -> None:
    for calm in (decision("decode", 2, 1), decision("decode", 2, 2, reason="hold: calm for 3s")):
        change = plan("prefill", 1, 2, other_last=calm)
        assert change is not None
        assert (change.replica, change.role, change.target_replicas) == ("decode-d2", "prefill", 1)
        assert change.reason.startswith("borrows decode-d2 from decode")


def test_no_borrow_from_a_pool_that_holds_grows_or_decided_long_ago() -> None:
    assert plan("prefill", 1, 2) is None  # the other pool has decided nothing
    assert (
        plan("prefill", 1, 2, other_last=decision("decode", 2, 2, reason="hold: within SLO"))
        is None
    )
    assert plan("prefill", 1, 2, other_last=decision("decode", 2, 3)) is None
    assert plan("prefill", 1, 2, other_last=decision("decode", 2, 1, age_s=31)) is None
    # Never the other pool's last replica serving its own calls.
    one = {"prefill": ["prefill-p1", "prefill-p2"], "decode": ["decode-d1"]}
    assert plan("decode", 1, 2, replicas=one, other_last=decision("prefill", 2, 1)) is not None
    lent = RoleTable(1, {"decode-d2": "prefill"})
    assert plan("prefill", 1, 2, table=lent, other_last=decision("decode", 2, 1)) is None


def test_a_pool_that_grows_recalls_its_lent_replica_first() -> None:
    lent = RoleTable(1, {"decode-d2": "prefill"})
    change = plan("decode", 2, 3, table=lent, other_last=decision("prefill", 1, 1))
    assert change is not None
    assert (change.replica, change.role, change.target_replicas) == ("decode-d2", "decode", 2)
    assert change.reason.startswith("recalls decode-d2")


def test_a_pool_that_would_shrink_holds_while_a_replica_is_lent() -> None:
    lent = RoleTable(1, {"decode-d2": "prefill"})
    hold = plan("decode", 2, 1, table=lent)
    assert hold is not None and hold.replica is None and hold.target_replicas == 2
    assert "decode-d2 lent to prefill is the spare" in hold.reason
    assert plan("decode", 2, 1) is None  # nothing lent: it scales down


def test_at_most_one_flip_per_interval() -> None:
    other = decision("decode", 2, 1)
    assert plan("prefill", 1, 2, other_last=other, last_flip_s=NOW - 10) is None
    assert plan("prefill", 1, 2, other_last=other, last_flip_s=NOW - 31) is not None
