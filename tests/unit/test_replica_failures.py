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
        self._engine_owner = SimpleNamespace(worker_id="decode-x1")  # type: ignore[assignment]


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
