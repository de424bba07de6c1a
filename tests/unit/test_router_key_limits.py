"""Per-key limits: the keys file's `concurrency=` / `rpm=` options (router/auth.py), the
per-replica limiter (router/key_limits.py) and the RouterService holding a key's slot for the
whole stream. The shared (Redis) limiter is tested against a real server in
tests/e2e/test_control_store.py, and on the served app in tests/e2e/test_api_keys.py."""

from __future__ import annotations

import asyncio

import pytest

from router.auth import NO_LIMITS, ApiKeys, KeyLimits, hash_key, key_line, new_key
from router.key_limits import KeyLimited, LocalKeyLimiter
from router.service import Caller, Overloaded, PreparedRequest, RouterService, StreamChunk
from tests.fakes import FakePrefill
from tests.unit.test_router_service import make_service, run


def test_the_keys_file_takes_limits_per_key() -> None:
    alice, batch = new_key(), new_key()
    keys = ApiKeys.parse(
        f"{key_line('alice', alice)}\n{key_line('batch', batch)} concurrency=4 rpm=600  # bulk\n"
    )
    assert keys.authenticate(batch) == "batch"
    assert keys.limits_of("batch") == KeyLimits(max_concurrent=4, max_per_minute=600)
    assert keys.limits_of("alice") == NO_LIMITS and not NO_LIMITS.any
    only_rate = ApiKeys.parse(f"bob {hash_key(alice)} rpm=1")
    assert only_rate.limits_of("bob") == KeyLimits(max_per_minute=1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("concurrency=0", "concurrency must be a whole number >= 1, got '0'"),
        ("rpm=1.5", "rpm must be a whole number >= 1, got '1.5'"),
        ("rps=3", "unknown option 'rps=3'"),
        ("concurrency", "unknown option 'concurrency'"),
        ("rpm=1 rpm=2", "rpm appears twice"),
    ],
)
def test_a_bad_limit_is_refused_naming_the_line_and_option(options: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ApiKeys.parse(f"# header\nbatch {hash_key(new_key())} {options}", "keys.txt")
    assert str(info.value).startswith("keys.txt, line 2: ")
    assert message in str(info.value)


async def test_the_local_limiter_counts_in_flight_and_per_minute() -> None:
    now = [600.0]
    limiter = LocalKeyLimiter(clock=lambda: now[0])
    two = KeyLimits(max_concurrent=2)
    await limiter.acquire("a", two, "r1")
    await limiter.acquire("a", two, "r2")
    with pytest.raises(KeyLimited, match=r"API key 'a' is at its limit \(at most 2 requests in"):
        await limiter.acquire("a", two, "r3")
    await limiter.acquire("b", two, "r3")  # another key has its own slots
    await limiter.release("a", "r1")
    await limiter.acquire("a", two, "r4")
    await limiter.release("a", "never-held")  # a no-op

    three = KeyLimits(max_per_minute=3)
    for i in range(3):
        await limiter.acquire("c", three, f"c{i}")
    with pytest.raises(KeyLimited, match="at most 3 requests per minute"):
        await limiter.acquire("c", three, "c3")
    now[0] += 59.0  # same minute (600 // 60 == 659 // 60)
    with pytest.raises(KeyLimited):
        await limiter.acquire("c", three, "c4")
    now[0] += 1.0  # the next minute
    await limiter.acquire("c", three, "c5")


async def test_the_service_holds_a_keys_slot_for_the_whole_stream_and_frees_it() -> None:
    gate = asyncio.Event()
    prefill = FakePrefill(gate=gate)
    service, finished = make_service(prefill)
    one = Caller("one", KeyLimits(max_concurrent=1))
    first = asyncio.ensure_future(
        _collect(service, service.prepare({"prompt": "one"}, "req-a", one))
    )
    await prefill.started.wait()
    with pytest.raises(Overloaded, match="API key 'one' is at its limit"):
        await _collect(service, service.prepare({"prompt": "two"}, "req-b", one))
    assert len(prefill.requests) == 1 and finished == []  # refused before the engines
    other = Caller("other", NO_LIMITS)
    gate.set()
    assert len(await _collect(service, service.prepare({"prompt": "x"}, "req-c", other))) == 5
    assert len(await first) == 5
    # A stream cancelled during its prefill gives its slot back too.
    gate.clear()
    cancelled = asyncio.ensure_future(
        _collect(service, service.prepare({"prompt": "three"}, "req-d", one))
    )
    while len(prefill.requests) < 3:
        await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.sleep(0)
    gate.set()  # the prefill ends, and its KV is given back
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert len(await _collect(service, service.prepare({"prompt": "four"}, "req-e", one))) == 5
    assert service.num_in_flight == 0
    assert await run(service, {"prompt": "no caller"})  # an app without keys: no limits


async def _collect(service: RouterService, prepared: PreparedRequest) -> list[StreamChunk]:
    return [chunk async for chunk in service.stream(prepared)]
