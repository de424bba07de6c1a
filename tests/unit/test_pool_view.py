"""What the Router sees of the pools for the prefill decision (router/pool_view.py)."""

from __future__ import annotations

from control.records import RoleTable
from router.pd_decision import PoolSnapshot
from router.pool_view import PoolView
from router.prefix import PrefixIndex, block_hashes
from tests.unit.test_control_records import make_load

NOW = 1_700_000_010.0


def test_prefill_is_the_prefix_owner_else_the_least_pending_and_dead_ones_are_skipped() -> None:
    view = PoolView(clock=lambda: NOW)
    assert view.prefill([1, 2, 3]) == (None, 0) and view.decode() is None
    busy = make_load(replica_id="prefill-aaa", num_pending_prefill_tokens=900, updated_at=NOW - 2)
    idle = make_load(replica_id="prefill-bbb", num_pending_prefill_tokens=100, updated_at=NOW - 1)
    dead = make_load(replica_id="prefill-ccc", num_pending_prefill_tokens=0, is_healthy=False)
    view.update("prefill", [busy, idle, dead, None])
    prompt = list(range(100))
    assert view.prefill(prompt) == (PoolSnapshot(100, 2, 1.0), 0)
    index = PrefixIndex(ttl_seconds=60)
    view.use_prefix_index(index, block_size=32)
    index.record(block_hashes(prompt, 32)[:2], "aaa")  # 64 of its tokens on the busy one
    assert view.prefill(prompt) == (PoolSnapshot(900, 2, 2.0), 64)
    index.record(block_hashes(prompt, 32)[2:], "ccc")  # a longer prefix, on a dead replica
    assert view.prefill(prompt) == (PoolSnapshot(900, 2, 2.0), 64)


def test_decode_is_the_replica_with_the_most_free_blocks() -> None:
    view = PoolView(clock=lambda: NOW)
    full = make_load(replica_id="decode-a", pool="decode", num_free_blocks=5, updated_at=NOW)
    roomy = make_load(
        replica_id="decode-b",
        pool="decode",
        num_free_blocks=60,
        num_running=7,
        num_pending_prefill_tokens=30,
        updated_at=NOW - 0.5,
    )
    view.update("decode", [full, roomy])
    assert view.decode() == PoolSnapshot(30, 7, 0.5)
    view.update("decode", [])
    assert view.decode() is None


def test_no_engine_serves_a_role_only_when_both_pools_were_seen_without_one() -> None:
    view = PoolView(clock=lambda: NOW)
    prefill = make_load(replica_id="prefill-a", updated_at=NOW)
    decode = make_load(replica_id="decode-b", pool="decode", updated_at=NOW)
    view.update("decode", [decode])
    assert not view.serves_none("prefill")  # the prefill pool not seen yet: not known
    view.update("prefill", [prefill])
    assert not view.serves_none("prefill") and not view.serves_none("decode")
    view.set_roles(RoleTable(1, {"prefill-a": "decode"}))  # the split lent it
    assert view.serves_none("prefill") and view.prefill([1, 2]) == (None, 0)
    assert not view.serves_none("decode")
    view.set_roles(RoleTable(2, {}))  # taken back
    assert not view.serves_none("prefill")
