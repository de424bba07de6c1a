"""Role flips' pure parts: which pool's calls a replica takes, and which pool's handle a call
of each role goes through (router/roles.py, control/records.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from control.records import RolesApplied, RoleTable, decode_roles_applied, encode_roles_applied
from engine.messages import ReplicaLoad
from router.pool_view import PoolView
from router.roles import pool_for, serving


def load(worker_id: str, pending: int = 0, free: int = 100, running: int = 0) -> ReplicaLoad:
    return ReplicaLoad(
        replica_id=worker_id,
        pool=worker_id.split("-")[0],
        num_pending_prefill_tokens=pending,
        num_running=running,
        num_waiting=0,
        kv_usage=1 - free / 100,
        num_total_blocks=100,
        num_free_blocks=free,
        updated_at=1_700_000_000.0,
    )


def test_a_replica_takes_its_own_pools_calls_until_flipped() -> None:
    table = RoleTable(version=3, flipped={"decode-d1": "prefill"})
    assert table.role_of("decode-d1") == "prefill"
    assert table.role_of("decode-d2") == "decode"
    assert table.role_of("prefill-p1") == "prefill"
    with pytest.raises(ValueError, match="pool must be one of"):
        RoleTable(flipped={"decode-d1": "engine"})
    with pytest.raises(ValueError, match="pool must be one of"):
        RoleTable(flipped={"router-r1": "decode"})
    with pytest.raises(ValueError, match="roles version"):
        RoleTable(version=-1)


def test_a_call_goes_through_a_pool_holding_replicas_of_its_role() -> None:
    loads = {
        "prefill": (load("prefill-p1", pending=900), load("prefill-p2", pending=400)),
        "decode": (load("decode-d1", pending=0, free=10), load("decode-d2", free=60)),
    }
    plain = RoleTable()
    assert pool_for("prefill", plain, loads) == "prefill"
    assert pool_for("decode", plain, loads) == "decode"
    # d1 lent to prefill: prefill calls go through either handle, a third through decode's.
    lent = RoleTable(version=1, flipped={"decode-d1": "prefill"})
    assert [x.replica_id for x in serving("prefill", lent, loads)] == [
        "prefill-p1", "prefill-p2", "decode-d1",
    ]  # fmt: skip
    rng = random.Random(0)
    picks = Counter(pool_for("prefill", lent, loads, rng) for _ in range(3000))
    assert 900 < picks["decode"] < 1100 and picks["prefill"] == 3000 - picks["decode"]
    assert pool_for("decode", lent, loads) == "decode"  # d2 is left, alone in its pool
    # Every decode replica lent away, p1 lent to decode: decode calls go to the prefill pool.
    swapped = RoleTable(2, {"decode-d1": "prefill", "decode-d2": "prefill", "prefill-p1": "decode"})
    assert pool_for("decode", swapped, loads) == "prefill"
    assert pool_for("prefill", swapped, loads, rng) in ("prefill", "decode")
    # With nothing reported, the role's own pool.
    assert pool_for("decode", swapped, {}) == "decode"


def test_the_pool_view_predicts_from_the_replicas_serving_each_role() -> None:
    view = PoolView(clock=lambda: 1_700_000_000.0)
    view.update("prefill", [load("prefill-p1", pending=500)])
    view.update("decode", [load("decode-d1", pending=0, free=90), load("decode-d2", free=20)])
    snapshot, _ = view.prefill((1, 2, 3))
    assert snapshot is not None and snapshot.queue_tokens == 500
    view.set_roles(RoleTable(1, {"decode-d1": "prefill"}))
    snapshot, _ = view.prefill((1, 2, 3))
    assert snapshot is not None and snapshot.queue_tokens == 0  # d1, idle
    # p1 and d1 take prefill calls: either pool's handle (at random, pool_for's test).
    assert {view.pool_for("prefill") for _ in range(200)} == {"prefill", "decode"}
    decode = view.decode()
    assert decode is not None and decode.num_running == 0
    # p1 lent to decode as well: d1 alone takes prefill calls, through the decode pool.
    view.set_roles(RoleTable(2, {"decode-d1": "prefill", "prefill-p1": "decode"}))
    assert {view.pool_for("prefill") for _ in range(200)} == {"decode"}
    assert view.pool_for("decode") in ("prefill", "decode")


def test_roles_applied_round_trip() -> None:
    applied = RolesApplied(7, 1_700_000_000.25)
    assert decode_roles_applied(encode_roles_applied(applied)) == applied
    assert decode_roles_applied(b"7 1700000000.25") == applied
    with pytest.raises(ValueError, match="roles applied must be"):
        decode_roles_applied("seven")
