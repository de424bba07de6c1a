"""The control plane's two faces (`ControlStore`, `SyncControlStore`) and the private
redis-server, against a real redis-server process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from control.records import DecisionRecord, PoolSLO, ReplicaBounds, RoleTable
from control.redis_server import RedisServer, restart_redis_server, start_redis_server
from control.store import ControlStore, LoadPublisher
from control.sync_store import SyncControlStore
from engine.messages import ReplicaLoad
from router.prefix import MatchResult, block_hashes, match_owners
from tests.hosts import Hosts


def make_load(replica_id: str, pool: str = "prefill", age_s: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(
        replica_id=replica_id,
        pool=pool,
        num_pending_prefill_tokens=900,
        num_running=3,
        num_waiting=1,
        kv_usage=0.4,
        num_total_blocks=100,
        num_free_blocks=60,
        updated_at=time.time() - age_s,
    )


def make_decision(index: int, pool: str = "prefill") -> DecisionRecord:
    return DecisionRecord(
        at=1_700_000_000.0 + index,
        pool=pool,
        current_replicas=index,
        target_replicas=index + 1,
        reason=f"decision {index}",
        inputs={"ttft_p95_s": index / 10},
    )


def app_keys(server: RedisServer, app: str) -> set[bytes]:
    client = redis.Redis.from_url(server.url)
    try:
        return set(client.scan_iter(match=f"pdserve:{app}:*"))
    finally:
        client.close()


# The server process


def test_server_is_private_and_outlives_its_session(
    redis_server: RedisServer, hosts: Hosts
) -> None:
    assert redis_server.is_running()
    assert os.getsid(redis_server.pid) != os.getsid(0)
    assert redis_server.host == hosts.ip("a")  # where the other test hosts reach it
    # The password travels through stdin, never argv (world-readable in /proc).
    cmdline = Path(f"/proc/{redis_server.pid}/cmdline").read_bytes()
    assert redis_server.password.encode() not in cmdline
    assert redis_server.password not in repr(redis_server)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    finally:
        client.close()


async def test_wrong_or_missing_password_is_refused(redis_server: RedisServer) -> None:
    wrong = redis_server.url.replace(redis_server.password, "not-the-password")
    with pytest.raises(redis.AuthenticationError):
        await ControlStore.connect(wrong, "demo")
    anonymous = f"redis://{redis_server.host}:{redis_server.port}/0"
    with pytest.raises(redis.AuthenticationError):
        await ControlStore.connect(anonymous, "demo")


def test_stop_leaves_no_process_and_is_idempotent(tmp_path: Path) -> None:
    server = start_redis_server(tmp_path)
    assert server.is_running()
    server.stop()
    assert not server.is_running()
    assert not Path(f"/proc/{server.pid}").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)
    server.stop()  # Gone already: nothing to signal.
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()


def test_start_failure_names_the_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="redis-server exited with code 1") as error:
        # TEST-NET-1: an address no interface here has, so redis cannot bind it.
        start_redis_server(tmp_path, host="192.0.2.1", port=6399)
    assert str(tmp_path / "redis-server.log") in str(error.value)
    assert "Cannot assign requested address" in str(error.value)


# Store round trips


async def test_replica_load_round_trip_and_staleness(control_store: ControlStore) -> None:
    fresh = [make_load("prefill-1"), make_load("prefill-0", age_s=5)]
    for load in [*fresh, make_load("prefill-old", age_s=120)]:
        await control_store.put_replica_load(load)
    await control_store.put_replica_load(make_load("decode-0", pool="decode"))

    assert await control_store.replica_loads("prefill") == sorted(
        fresh, key=lambda load: load.replica_id
    )
    assert len(await control_store.replica_loads("prefill", max_age_s=600)) == 3
    assert [s.replica_id for s in await control_store.replica_loads("decode")] == ["decode-0"]
    with pytest.raises(ValueError, match="pool must be one of"):
        await control_store.put_replica_load(make_load("engine-0", pool="engine"))


async def test_a_replica_publishes_its_load_through_a_pickled_publisher(
    control_store: ControlStore, redis_server: RedisServer
) -> None:
    # What build_app puts in a pool's settings and Serve pickles into the replica.
    publisher = pickle.loads(pickle.dumps(LoadPublisher(redis_server.url, control_store.app)))
    await publisher.publish(make_load("decode-7", pool="decode"))
    await publisher.publish(make_load("decode-7", pool="decode", age_s=1))  # the latest wins
    (stored,) = await control_store.replica_loads("decode")
    assert stored.replica_id == "decode-7" and stored.updated_at < time.time() - 0.5
    assert redis_server.password not in repr(publisher)


async def test_prefix_index_match_and_expiry(control_store: ControlStore) -> None:
    async def longest_match(hashes: list[bytes], eligible: set[str] | None = None) -> MatchResult:
        return match_owners(await control_store.prefix_owners(hashes), eligible)

    hashes = list(block_hashes(list(range(40)), block_size=8))  # 5 full blocks.
    assert await control_store.prefix_owners(hashes) == [None] * 5
    assert await longest_match(hashes) == MatchResult(None, 0)

    await control_store.record_prefix(hashes[:3], "prefill-a", ttl_s=60)
    await control_store.record_prefix(hashes[:2], "prefill-b", ttl_s=2.0)  # Last writer wins.
    assert await control_store.prefix_owners(hashes) == [
        "prefill-b", "prefill-b", "prefill-a", None, None,
    ]  # fmt: skip
    assert await longest_match(hashes) == MatchResult("prefill-a", 3)
    assert await longest_match(hashes, {"prefill-b"}) == MatchResult("prefill-b", 2)

    await asyncio.sleep(2.3)
    # Block 0 expired, so nothing chains from it even though block 2 is still owned.
    assert await control_store.prefix_owners(hashes[:3]) == [None, None, "prefill-a"]
    assert await longest_match(hashes) == MatchResult(None, 0)
    assert await control_store.prefix_owners([]) == []


async def test_samples_are_newest_first_and_capped(control_store: ControlStore) -> None:
    for index in range(10):
        await control_store.record_sample("ttft", index * 0.125, cap=4)
    assert await control_store.recent_samples("ttft") == [1.125, 1.0, 0.875, 0.75]
    assert await control_store.recent_samples("ttft", n=2) == [1.125, 1.0]
    assert await control_store.recent_samples("tpot") == []
    with pytest.raises(ValueError, match="finite number"):
        await control_store.record_sample("tpot", float("inf"))
    with pytest.raises(ValueError, match="metric must be one of"):
        await control_store.record_sample("latency", 0.1)


async def test_a_requests_samples_go_together_or_not_at_all(control_store: ControlStore) -> None:
    await control_store.record_samples({"queue_wait": 0.5, "prefill": 0.25})
    assert await control_store.recent_samples("queue_wait") == [0.5]
    assert await control_store.recent_samples("prefill") == [0.25]
    with pytest.raises(ValueError, match="metric must be one of"):
        await control_store.record_samples({"queue_wait": 0.75, "latency": 0.1})
    assert await control_store.recent_samples("queue_wait") == [0.5]  # nothing written


async def test_default_sample_cap(control_store: ControlStore) -> None:
    for start in range(0, 2100, 300):
        for index in range(start, min(start + 300, 2100)):
            await control_store.record_sample("kv_transfer", float(index))
    samples = await control_store.recent_samples("kv_transfer", n=5000)
    assert len(samples) == 2048
    assert samples[0] == 2099.0
    assert samples[-1] == 2099.0 - 2047


def test_slo_bounds_and_pins(control_store: ControlStore, redis_server: RedisServer) -> None:
    with SyncControlStore.connect(redis_server.url, control_store.app) as store:
        assert store.get_slo() is None
        assert store.get_bounds("prefill") is None
        assert store.pins() == {"prefill": None, "decode": None}

        assert store.set_slo(ttft_p95_s=2.0) == PoolSLO(ttft_p95_s=2.0, tpot_p95_s=0.2)
        assert store.set_slo(tpot_p95_s=0.1) == PoolSLO(ttft_p95_s=2.0, tpot_p95_s=0.1)
        assert store.set_bounds("prefill", 1, 6) == ReplicaBounds(1, 6)
        store.pin("decode", 4)
        assert store.get_slo() == PoolSLO(ttft_p95_s=2.0, tpot_p95_s=0.1)
        assert store.get_bounds("prefill") == ReplicaBounds(1, 6)
        assert store.get_bounds("decode") is None
        assert store.pins() == {"prefill": None, "decode": 4}
        assert store.pool_settings("decode") == (PoolSLO(2.0, 0.1), None, 4)

        store.pin("decode", 0)
        assert store.pins()["decode"] == 0
        assert store.unpin("decode")
        assert not store.unpin("decode")  # Releasing no pin is fine.
        assert store.pins()["decode"] is None
        with pytest.raises(ValueError, match="pin must be an int"):
            store.pin("decode", -1)


def test_decision_log_order_filter_and_cap(
    control_store: ControlStore, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("control.sync_store.DECISION_CAP", 120)
    with SyncControlStore.connect(redis_server.url, control_store.app) as store:
        assert store.recent_decisions() == []
        for index in range(150):
            store.append_decision(
                make_decision(index, pool="decode" if index % 10 == 0 else "prefill")
            )
        newest = store.recent_decisions(n=3)
        assert newest == [make_decision(149), make_decision(148), make_decision(147)]
        # Decode decisions sit far apart in the shared list: the pool filter reads past them.
        decode = store.recent_decisions(5, pool="decode")
        assert [record.at - 1_700_000_000 for record in decode] == [140, 130, 120, 110, 100]
        # The cap kept only the newest 120 (30..149): decode decisions 0, 10, 20 are gone.
        everything = store.recent_decisions(100, pool="decode")
        assert [record.current_replicas for record in everything][-1] == 30
        assert len(store.recent_decisions(n=1000)) == 120


def test_latest_decision_per_pool_is_overwritten_every_tick(
    control_store: ControlStore, redis_server: RedisServer
) -> None:
    with SyncControlStore.connect(redis_server.url, control_store.app) as store:
        assert store.last_decision("prefill") is None
        for index in range(3):
            store.set_last_decision(make_decision(index, pool="prefill"))
        store.set_last_decision(make_decision(7, pool="decode"))
        assert store.last_decision("prefill") == make_decision(2, pool="prefill")
        assert store.last_decision("decode") == make_decision(7, pool="decode")
        assert store.recent_decisions() == []  # the latest is not the log


async def test_apps_do_not_see_each_others_keys(redis_server: RedisServer) -> None:
    one = await ControlStore.connect(redis_server.url, "isolation-one")
    two = await ControlStore.connect(redis_server.url, "isolation-two")
    try:
        hashes = block_hashes(list(range(16)), block_size=8)
        await one.put_replica_load(make_load("decode-0", pool="decode"))
        await one.record_prefix(hashes, "prefill-0", ttl_s=60)
        await one.record_sample("tpot", 0.05)
        with SyncControlStore.connect(redis_server.url, "isolation-one") as sync_one:
            sync_one.set_slo(ttft_p95_s=5.0)
            sync_one.set_bounds("decode", 1, 64)
            sync_one.pin("decode", 2)
            sync_one.append_decision(make_decision(1))

        assert await two.replica_loads("decode") == []
        assert await two.prefix_owners(hashes) == [None, None]
        assert await two.recent_samples("tpot") == []
        with SyncControlStore.connect(redis_server.url, "isolation-two") as sync_two:
            assert sync_two.pool_settings("decode") == (None, None, None)
            assert sync_two.recent_decisions() == []
        assert len(app_keys(redis_server, "isolation-one")) == 8
        assert app_keys(redis_server, "isolation-two") == set()
    finally:
        await one.close()
        await two.close()


async def test_store_works_on_a_decoding_client(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    store = ControlStore(client, "decoding-client")
    try:
        await store.record_prefix(block_hashes([1, 2], block_size=2), "prefill-0", ttl_s=5)
        await store.record_sample("queue_wait", 0.5)
        await store.put_replica_load(make_load("prefill-0"))
        assert await store.prefix_owners(block_hashes([1, 2], block_size=2)) == ["prefill-0"]
        assert await store.recent_samples("queue_wait") == [0.5]
        assert len(await store.replica_loads("prefill")) == 1
    finally:
        await store.close()


async def test_api_key_limits_hold_across_two_routers(
    control_store: ControlStore, redis_server: RedisServer
) -> None:
    """Two routers (own stores, own limiters) share one key's slots: concurrency=2 admits two
    in all, a slot given back is free for either, and rpm=3 counts both routers' requests."""
    from router.auth import KeyLimits
    from router.key_limits import KeyLimited, SharedKeyLimiter

    other = await ControlStore.connect(redis_server.url, control_store.app)
    try:
        first, second = SharedKeyLimiter(control_store), SharedKeyLimiter(other)
        two = KeyLimits(max_concurrent=2)
        await first.acquire("team", two, "r1")
        await second.acquire("team", two, "r2")
        with pytest.raises(KeyLimited, match="at most 2 requests in flight"):
            await first.acquire("team", two, "r3")
        with pytest.raises(KeyLimited):
            await second.acquire("team", two, "r3")
        assert await control_store.key_slots_in_flight("team") == 2
        await second.release("team", "r2")
        await first.acquire("team", two, "r3")
        await first.release("team", "r1")
        await first.release("team", "r3")
        assert await other.key_slots_in_flight("team") == 0

        three = KeyLimits(max_per_minute=3)
        if time.time() % 60 > 55:  # the three calls below must fall in one minute of Redis's
            await asyncio.sleep(6)
        await first.acquire("batch", three, "b1")
        await second.acquire("batch", three, "b2")
        await first.acquire("batch", three, "b3")
        with pytest.raises(KeyLimited, match="at most 3 requests per minute"):
            await second.acquire("batch", three, "b4")
        await first.close()
        await second.close()
    finally:
        await other.close()


async def test_a_dead_routers_key_slots_expire_and_a_live_ones_are_refreshed(
    control_store: ControlStore,
) -> None:
    """A slot is a lease: a router that stops refreshing (it died) frees it within the lease,
    while one that lives refreshes the slots of the requests it still streams."""
    from router.auth import KeyLimits
    from router.key_limits import KeyLimited, SharedKeyLimiter

    one = KeyLimits(max_concurrent=1)
    live = SharedKeyLimiter(control_store, lease_s=0.6)  # refreshes every 0.2 s
    await live.acquire("live", one, "l1")
    dead = SharedKeyLimiter(control_store, lease_s=0.6)
    await dead.acquire("dead", one, "d1")
    await dead.close()  # stops refreshing, as a router that died
    await asyncio.sleep(1.5)  # 2.5 leases
    assert await control_store.key_slots_in_flight("dead") == 0
    await live.acquire("dead", one, "d2")  # the dead router's slot is free again
    assert await control_store.key_slots_in_flight("live") == 1  # refreshed: still held
    with pytest.raises(KeyLimited):
        await live.acquire("live", one, "l2")
    await live.release("live", "l1")
    await live.release("dead", "d2")
    assert await control_store.key_slots_in_flight("live") == 0
    await live.close()


async def test_routing_lookups_stay_fast_while_redis_is_silent_or_gone(tmp_path: Path) -> None:
    """The prefill router's prefix index in Redis (router/replica_router.py): while the server
    is frozen (SIGSTOP: a partition's silence) each lookup gives up at its 50 ms bound, and after
    three in a row the breaker skips Redis; once the server answers again a trial lookup finds
    the records it kept. A stopped server refuses the connection, and each lookup says so at
    once, well inside its bound (redis-py's own retries with backoff would hold it the whole
    50 ms); then the breaker skips it the same way."""
    import signal

    from control.breaker import CircuitBreaker
    from router.replica_router import SharedPrefixIndex

    server = start_redis_server(tmp_path)
    store = ControlStore.from_url(server.url, "demo")
    index = SharedPrefixIndex(store, breaker=CircuitBreaker(threshold=3, open_s=0.5))
    hashes = block_hashes(list(range(96)), 32)

    async def timed_owners() -> tuple[list[str | None] | None, float]:
        started = time.perf_counter()
        owners = await index.owners(hashes)
        return owners, time.perf_counter() - started

    try:
        index.record(hashes, "prefill-a", 60.0)
        deadline = time.monotonic() + 5
        while (await index.owners(hashes)) != ["prefill-a"] * 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        os.kill(server.pid, signal.SIGSTOP)
        tries = [await timed_owners() for _ in range(5)]
        assert [owners for owners, _ in tries] == [None] * 5
        assert all(0.04 <= seconds < 0.5 for _, seconds in tries[:3]), tries
        assert index.breaker.is_open
        assert all(seconds < 0.005 for _, seconds in tries[3:]), tries  # Redis not asked
        os.kill(server.pid, signal.SIGCONT)
        await asyncio.sleep(0.6)  # the breaker's open time
        assert await index.owners(hashes) == ["prefill-a"] * 3
        assert not index.breaker.is_open
        server.stop()
        gone = [await timed_owners() for _ in range(4)]
        assert [owners for owners, _ in gone] == [None] * 4
        assert all(seconds < 0.03 for _, seconds in gone), gone
        assert index.breaker.is_open
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        server.stop()
        await store.close()


async def test_a_restarted_redis_answers_the_first_call_after_it(tmp_path: Path) -> None:
    """A pooled connection that Redis closed when it went down is replaced within the call
    that finds it closed (one immediate retry): the first call after a restart succeeds. While
    the server is down a call fails at once, not after retries."""
    server = start_redis_server(tmp_path, persist=True)
    store = ControlStore.from_url(server.url, "demo")
    try:
        assert await store.ping()  # the pool now holds a connection
        server = restart_redis_server(server)  # same address and password
        assert await store.ping()  # on that connection, which the old server closed
        server.stop()
        started = time.perf_counter()
        with pytest.raises(redis.exceptions.ConnectionError):
            await store.ping()
        assert time.perf_counter() - started < 0.1
    finally:
        server.stop()
        await store.close()


def test_a_restarted_redis_answers_the_autoscalers_first_read_after_it(tmp_path: Path) -> None:
    """The same for the sync store the autoscaling policies read each tick: its pool checks a
    pooled connection before use (redis-py's sync `get_connection`), so with no retry of its
    own the first read after a restart is served on a new connection; with the server gone a
    read fails at once."""
    server = start_redis_server(tmp_path, persist=True)
    store = SyncControlStore.connect(server.url, "demo")
    try:
        store.pin("decode", 3)  # the pool now holds a connection
        server = restart_redis_server(server)
        assert store.pool_settings("decode").pin == 3
        server.stop()
        started = time.perf_counter()
        with pytest.raises(redis.exceptions.ConnectionError):
            store.pool_settings("decode")
        assert time.perf_counter() - started < 0.1
    finally:
        server.stop()
        store.close()


async def test_api_key_limits_stay_fast_while_redis_is_silent(tmp_path: Path) -> None:
    """Per-key limits in Redis (router/key_limits.py) while the server is frozen (SIGSTOP):
    each acquire gives up at its 100 ms bound and serves the request without limits; after
    three in a row the breaker skips Redis; once the server answers again the limits hold."""
    import signal

    from control.breaker import CircuitBreaker
    from router.auth import KeyLimits
    from router.key_limits import KeyLimited, SharedKeyLimiter

    server = start_redis_server(tmp_path)
    store = ControlStore.from_url(server.url, "demo")
    limiter = SharedKeyLimiter(store, breaker=CircuitBreaker(threshold=3, open_s=0.5))
    one = KeyLimits(max_concurrent=1)

    async def timed_acquire(request_id: str) -> float:
        started = time.perf_counter()
        await limiter.acquire("team", one, request_id)  # never refused while Redis is silent
        return time.perf_counter() - started

    try:
        await limiter.acquire("team", one, "held")
        with pytest.raises(KeyLimited):
            await limiter.acquire("team", one, "second")
        os.kill(server.pid, signal.SIGSTOP)
        tries = [await timed_acquire(f"frozen-{i}") for i in range(5)]
        assert all(0.09 <= seconds < 0.5 for seconds in tries[:3]), tries
        assert limiter.breaker.is_open
        assert all(seconds < 0.005 for seconds in tries[3:]), tries  # Redis not asked
        os.kill(server.pid, signal.SIGCONT)
        await asyncio.sleep(0.6)  # the breaker's open time
        with pytest.raises(KeyLimited):  # "held" still holds the key's one slot
            await limiter.acquire("team", one, "after")
        assert not limiter.breaker.is_open
        await limiter.release("team", "held")
        await limiter.acquire("team", one, "after")
        await limiter.release("team", "after")
        await limiter.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        server.stop()
        await store.close()


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_operator_settings_survive_a_restart_of_a_persisted_server(
    tmp_path: Path, how: str
) -> None:
    """`pdserve up`'s Redis keeps an append-only file: SLOs, bounds and pins set at run time
    come back after the server stops or is killed (SIGKILL 1.5 s after the last write: the
    file is fsync'd each second)."""
    import signal

    from control.redis_server import restart_redis_server
    from control.sync_store import SyncControlStore

    server = start_redis_server(tmp_path, persist=True)
    try:
        with SyncControlStore.connect(server.url, "persisted") as store:
            slo = store.set_slo(ttft_p95_s=1.5, tpot_p95_s=0.25)
            bounds = store.set_bounds("decode", 2, 6)
            store.pin("prefill", 3)
        if how == "killed":
            time.sleep(1.5)
            os.kill(server.pid, signal.SIGKILL)
        server = restart_redis_server(server)
        with SyncControlStore.connect(server.url, "persisted") as store:
            assert store.get_slo() == slo
            assert store.get_bounds("decode") == bounds
            assert store.pins()["prefill"] == 3
    finally:
        server.stop()
    unpersisted = start_redis_server(tmp_path / "plain")
    try:
        with SyncControlStore.connect(unpersisted.url, "plain") as store:
            store.set_slo(ttft_p95_s=1.5)
        unpersisted = restart_redis_server(unpersisted)  # restarted persisted: nothing to load
        with SyncControlStore.connect(unpersisted.url, "plain") as store:
            assert store.get_slo() is None
    finally:
        unpersisted.stop()


# Role flips: the operator's flip, the routers' poll and ack (router/roles.py)


async def test_a_flip_reaches_each_polling_router_which_acks_it(
    control_store: ControlStore, redis_server: RedisServer
) -> None:
    from deploy.cli_ops import flip_role
    from router.pool_view import PoolView
    from router.roles import RolePoller, serving

    app = control_store.app
    idle = dataclasses.replace(make_load("decode-d1", pool="decode"), num_pending_prefill_tokens=0)
    await control_store.put_replica_load(idle)
    await control_store.put_replica_load(make_load("prefill-p1"))  # 900 tokens pending
    views = [PoolView(), PoolView()]
    pollers = [RolePoller(control_store, view, f"router-{i}") for i, view in enumerate(views)]
    tasks = [asyncio.create_task(p.run()) for p in pollers]
    try:
        with SyncControlStore.connect(redis_server.url, app) as store:
            # Both routers acked version 0 (no flip yet): they count as live.
            await wait_until(lambda: len(store.roles_applied()) == 2)
            flip = await asyncio.to_thread(flip_role, store, "decode-d1", "prefill")
            assert (flip.version, flip.num_routers) == (1, 2)
            assert flip.seconds > 0  # its P50 is measured by bench/role_flips.py
            for view in views:
                assert view.roles.role_of("decode-d1") == "prefill"
                assert view.roles.version == 1
                # No routing call filled these views: the replicas' published loads did, so a
                # fresh router sends prefill calls through the decode pool's handle too.
                assert view.knows("prefill") and view.knows("decode")
                assert [x.replica_id for x in serving("prefill", view.roles, view.loads)] == [
                    "prefill-p1", "decode-d1",
                ]  # fmt: skip
            assert {a.version for a in store.roles_applied().values()} == {1}
            # Back to its own pool: the entry goes, the version still counts up.
            back = await asyncio.to_thread(flip_role, store, "decode-d1", "decode")
            assert back.version == 2 and store.role_table() == RoleTable(2, {})
            assert all(view.roles == RoleTable(2, {}) for view in views)
            with pytest.raises(ValueError, match="never reported"):
                store.flip("decode-nobody", "prefill")
            with pytest.raises(ValueError, match="pool must be one of"):
                store.flip("decode-d1", "colocated")
            # A router that stops polling is named when the next flip times out on it.
            tasks[1].cancel()
            with pytest.raises(TimeoutError, match="router-1 did not apply roles version 3"):
                await asyncio.to_thread(flip_role, store, "prefill-p1", "decode", 0.5)
            assert views[0].roles.role_of("prefill-p1") == "decode"
            assert views[1].roles.version == 2
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
