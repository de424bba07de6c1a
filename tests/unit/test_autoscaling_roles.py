"""Flip first, start second (autoscaling/roles.py): which flip, if any, replaces a pool's
scale decision."""

from __future__ import annotations

import pytest

from autoscaling.config import AutoscalingConfig
from autoscaling.roles import (
    Stalls,
    Work,
    plan_role_change,
    plan_split,
    pool_stalls,
    pool_work,
    replica_work,
    stalls_from_inputs,
    work_from_inputs,
)
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


# The split follows the work (plan_split): engines of four, two in each pool.
FOUR = {"prefill": ["prefill-p1", "prefill-p2"], "decode": ["decode-d1", "decode-d2"]}


def split(pool: str, work: Work, **kw: object):  # type: ignore[no-untyped-def]
    args = {
        "table": RoleTable(),
        "replicas": FOUR,
        "now_s": NOW,
        "last_flip_s": None,
        "min_interval_s": 30.0,
        "min_load": 0.4,
    } | kw
    return plan_split(pool, 2, work, **args)  # type: ignore[arg-type]


def test_replica_work_is_in_replicas_at_the_policy_targets() -> None:
    config = AutoscalingConfig(target_utilization=0.8, slo_headroom=0.8, kv_usage_target=0.7)
    metrics = {BUSY_FRACTION: 0.4, TPOT_P95_S: 0.12, KV_CACHE_USAGE: 0.35}
    work = replica_work(metrics, 0.3, config)
    assert work.prefill == pytest.approx(0.5)
    assert work.decode == pytest.approx(0.5)  # 0.12 / (0.8 x 0.3), KV 0.35 / 0.7 the same
    # KV usage drives it when it is the larger; "no sample" (-1) and absent keys count as none.
    assert replica_work({TPOT_P95_S: -1.0, KV_CACHE_USAGE: 0.56}, 0.3, config) == pytest.approx(
        Work(0.0, 0.8)
    )
    both = pool_work([metrics, {BUSY_FRACTION: 0.8}], 0.3, config)
    assert both == pytest.approx(Work(1.5, 0.5))
    assert work_from_inputs({"work_prefill": 1.5, "work_decode": 0.5}) == Work(1.5, 0.5)
    assert work_from_inputs({"work_prefill": 1.5}) is None


def test_stalls_are_the_longest_prompts_and_the_shortest_gap_over_engines() -> None:
    decoding = {
        LOCAL_PREFILL_STEP_P95_S: 0.08,
        PREFILL_STEP_P95_S: NO_SAMPLE,
        TPOT_P50_S: 0.06,
    }
    prefilling = {PREFILL_STEP_P95_S: 0.5, TPOT_P50_S: NO_SAMPLE}
    busier = {LOCAL_PREFILL_STEP_P95_S: 0.2, TPOT_P50_S: 0.07}
    stalls = pool_stalls([decoding, prefilling, busier])
    assert stalls == Stalls(local_s=0.2, remote_s=0.5, tpot_median_s=0.06)
    assert stalls.added_s(stalls.local_s) == pytest.approx(0.14)
    assert stalls.added_s(0.01) == 0.0 and stalls.added_s(None) is None
    assert pool_stalls([]) == Stalls() and pool_stalls([{TPOT_P50_S: -1.0}]) == Stalls()
    # A pool's record holds what it sampled; the other pool's is merged in the same way.
    assert stalls_from_inputs(Stalls(0.2, None, 0.06).as_inputs()) == Stalls(0.2, None, 0.06)
    assert stalls_from_inputs({}) | Stalls(None, 0.5, 0.07) == Stalls(None, 0.5, 0.07)


def test_a_decode_heavy_app_moves_one_prefill_engine_to_decode_and_stays() -> None:
    work = Work(prefill=0.2, decode=2.4)  # prefill share 0.08: 3.7 of 4 engines should decode
    change = split("decode", work)
    assert change is not None
    assert (change.replica, change.role, change.target_replicas) == ("prefill-p2", "decode", 2)
    assert "prefill share 0.08" in change.reason and "borrows prefill-p2" in change.reason
    assert split("prefill", work) is None  # prefill is over its share, it never gives by itself
    # After the flip neither side is a whole engine short: no flip back, no second flip (one
    # prefill engine is the least).
    flipped = RoleTable(1, {"prefill-p2": "decode"})
    assert split("decode", work, table=flipped) is None
    assert split("prefill", work, table=flipped) is None


def test_the_split_holds_when_the_share_is_met_idle_or_the_giver_would_breach() -> None:
    assert split("decode", Work(1.0, 1.0)) is None  # 2:2 is the share
    assert split("prefill", Work(1.0, 1.0)) is None
    assert split("decode", Work(0.0, 0.0)) is None  # idle: no share
    assert split("decode", Work(0.02, 0.6)) is None  # decode 0.3 per engine: near idle
    # One prefill engine fewer would be 1.5 replicas' worth of prefill on one engine.
    assert split("decode", Work(1.5, 9.0)) is None
    # At most one flip per interval.
    assert split("decode", Work(0.2, 2.4), last_flip_s=NOW - 10) is None
    assert split("decode", Work(0.2, 2.4), last_flip_s=NOW - 31) is not None


def test_a_pool_short_of_its_share_recalls_its_lent_engine_first() -> None:
    lent = RoleTable(1, {"prefill-p2": "decode"})  # 1:3
    change = split("prefill", Work(prefill=2.4, decode=0.3), table=lent)
    assert change is not None
    assert (change.replica, change.role) == ("prefill-p2", "prefill")
    assert "recalls prefill-p2" in change.reason


# min_prefill_engines 0: the split may lend the last prefill engine (1:3 -> 0:4) and take one
# back, by the stalls against the limit (the TPOT SLO, 50 ms here). In 1:3 prefill-p2 decodes.
ONE_TO_THREE = RoleTable(1, {"prefill-p2": "decode"})
ZERO_TO_FOUR = RoleTable(2, {"prefill-p1": "decode", "prefill-p2": "decode"})
LIMIT_S = 0.05


def test_the_last_prefill_engine_goes_to_decoding_when_no_prompt_would_stall_locally() -> None:
    decode_heavy = Work(prefill=0.6, decode=2.4)
    # Its prompts would add 20 ms to a 60 ms gap, the local ones 10 ms: within 50 and 40 ms.
    short = Stalls(local_s=0.07, remote_s=0.08, tpot_median_s=0.06)

    def lend(work: Work = decode_heavy, stalls: Stalls = short, **kw: object):  # type: ignore[no-untyped-def]
        args = {"table": ONE_TO_THREE, "min_prefill_engines": 0, "stall_limit_s": LIMIT_S} | kw
        return split("decode", work, stalls=stalls, **args)

    change = lend()
    assert change is not None
    assert (change.replica, change.role, change.target_replicas) == ("prefill-p1", "decode", 2)
    assert "would add 20 ms (the prefill engine's) and 10 ms (the local ones)" in change.reason
    assert "within 50 ms (40 ms for the local ones): every prompt local: borrows prefill-p1" in (
        change.reason
    )
    assert lend(min_prefill_engines=1) is None  # the default keeps one
    assert lend(stalls=short._replace(remote_s=0.2)) is None  # its prompts would stall
    assert lend(stalls=short._replace(local_s=0.1)) is not None  # local ones add 40 ms
    assert lend(stalls=short._replace(local_s=0.11)) is None  # 50 ms: over 0.8 of the limit
    assert lend(work=Work(prefill=0.6, decode=1.0)) is None  # decode near idle: nothing to gain
    # A prefill engine that computed nothing lately goes when it is near idle.
    assert lend(stalls=short._replace(remote_s=None), work=Work(0.1, 2.4)) is not None
    assert lend(stalls=short._replace(remote_s=None)) is None
    # Two prefill engines: the share rule, not this one, moves the first.
    assert "prefill share" in split("decode", Work(0.2, 2.4), min_prefill_engines=0).reason


def test_with_no_prefill_engine_local_prompts_that_stall_take_one_back() -> None:
    def back(local_s: float | None, **kw: object):  # type: ignore[no-untyped-def]
        stalls = Stalls(local_s=local_s, tpot_median_s=0.06)
        args = {"table": ZERO_TO_FOUR, "min_prefill_engines": 0, "stall_limit_s": LIMIT_S} | kw
        return split("prefill", Work(0.0, 3.0), stalls=stalls, **args)

    change = back(0.7)
    assert change is not None
    assert (change.replica, change.role) == ("prefill-p1", "prefill")
    assert "no engine serves prefill and local prompts add 640 ms to a gap, past 50 ms" in (
        change.reason
    )
    assert "recalls prefill-p1" in change.reason
    # Between 0.8 of the limit and the limit, neither side flips (the hysteresis).
    assert back(0.11) is None and back(None) is None
    stalls = Stalls(local_s=0.11, remote_s=None, tpot_median_s=0.06)
    assert (
        split(
            "decode",
            Work(0.0, 3.0),
            table=ZERO_TO_FOUR,
            min_prefill_engines=0,
            stalls=stalls,
            stall_limit_s=LIMIT_S,
        )
        is None
    )
    assert back(0.7, last_flip_s=NOW - 10) is None  # at most one flip per interval
    # With no prefill-pool replica to recall, it borrows the decode pool's last engine.
    decode_only = {"decode": ["decode-d1", "decode-d2", "decode-d3"]}
    change = back(0.7, table=RoleTable(), replicas=decode_only)
    assert change is not None and (change.replica, change.role) == ("decode-d3", "prefill")
    with pytest.raises(ValueError, match="min_prefill_engines"):
        back(0.7, min_prefill_engines=2)
