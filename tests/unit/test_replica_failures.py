"""What a served engine replica raises when a call fails: the request's own fault as it is,
anything else as a ReplicaFailure naming the replica, which survives pickling (Ray)."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import pytest

from engine.messages import KVHandshakeError, KVTransferError, ReplicaFailure
from prefill_workers.replica import ReplicaShell


class Shell(ReplicaShell):
    pool = "decode"

    def __init__(self) -> None:
        # An engine that has only a name (and stops when the shell is collected).
        self._engine_owner = SimpleNamespace(  # type: ignore[assignment]
            worker_id="decode-x1", shutdown=lambda: None
        )


def test_an_engine_failure_leaves_as_a_replica_failure_naming_the_replica() -> None:
    with pytest.raises(ReplicaFailure) as raised, Shell().failures_named():
        raise KVTransferError("lease for req-1 expired 2.0 s ago")
    failure = raised.value
    assert failure.replica_id == "decode-x1"
    assert str(failure) == "decode-x1: KVTransferError: lease for req-1 expired 2.0 s ago"
    assert isinstance(failure.__cause__, KVTransferError)
    copy = pickle.loads(pickle.dumps(failure))
    assert (copy.replica_id, str(copy)) == (failure.replica_id, str(failure))


@pytest.mark.parametrize(
    "error", [ValueError("prompt too long"), KVHandshakeError("layouts differ")]
)
def test_the_requests_own_fault_leaves_as_it_is(error: Exception) -> None:
    with pytest.raises(type(error)) as raised, Shell().failures_named():
        raise error
    assert raised.value is error


def test_a_cancel_is_not_a_failure() -> None:
    with pytest.raises(asyncio.CancelledError), Shell().failures_named():
        raise asyncio.CancelledError()


class _Engine:
    """Holds KV until released; counts its stops."""

    def __init__(self) -> None:
        self.worker_id = "prefill-x1"
        self.released = asyncio.Event()
        self.num_stops = 0

    async def wait_drained(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.released.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def shutdown(self) -> None:
        self.num_stops += 1


async def test_a_stopping_shell_drains_only_when_told_to_and_stops_once() -> None:
    """`__del__` is what Serve's graceful shutdown calls (and awaits what it returns): with no
    drain it stops the engine at once and returns nothing; with one it returns the wait, and
    the engine stops once its KV is released. Called again (the garbage collector), nothing."""
    quick, engine = Shell(), _Engine()
    quick._engine_owner = engine  # type: ignore[assignment]
    assert quick.__del__() is None and engine.num_stops == 1
    assert quick.__del__() is None and engine.num_stops == 1

    draining, engine = Shell(), _Engine()
    draining._engine_owner = engine  # type: ignore[assignment]
    draining.drain_timeout_s = 30
    wait = draining.__del__()
    assert wait is not None and draining.__del__() is None
    task = asyncio.ensure_future(wait)
    await asyncio.sleep(0.05)
    assert not task.done() and engine.num_stops == 0
    engine.released.set()
    await asyncio.wait_for(task, 5)
    assert engine.num_stops == 1
