"""The NIXL read deadline (kv_transfer/nixl_connector.py): which reads are past it, and what the
wrapped poll does with them. The poll's owner here is a stand-in holding vLLM's three members
the wrapper touches; the served path is tested in tests/engine/test_kv_lifecycle.py."""

from __future__ import annotations

import pytest

from kv_transfer.nixl_connector import TransferDeadline, bound_reads
from tests.clock import FakeClock


def test_a_read_expires_timeout_after_it_was_first_seen() -> None:
    clock = FakeClock(100.0)
    deadline = TransferDeadline(5.0, clock)
    assert deadline.expired(["a"]) == []
    clock.now += 3
    assert deadline.expired(["a", "b"]) == []  # b starts now
    clock.now += 2.5
    assert deadline.expired(["a", "b"]) == ["a"]
    clock.now += 3
    assert sorted(deadline.expired(["a", "b"])) == ["a", "b"]
    # A read that left and comes back (same id, a later attempt) starts again.
    assert deadline.expired(["b"]) == ["b"]
    assert deadline.expired(["a", "b"]) == ["b"]


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_timeout_must_be_positive(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        TransferDeadline(timeout_s)


class Worker:
    """vLLM's poll reports nothing done (every read stays in PROC); a release fails for the
    handles in `stuck`."""

    def __init__(self, stuck: frozenset[int] = frozenset()) -> None:
        self._recving_transfers: dict[str, list[int]] = {}
        self.released: list[int] = []
        self._stuck = stuck

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        return set(), set()

    def _handle_failed_transfer(self, req_id: str, handle: int, failed: set[str]) -> bool:
        failed.add(req_id)
        if handle in self._stuck:
            return False
        self.released.append(handle)
        return True


def test_an_expired_read_is_failed_and_its_handles_released() -> None:
    clock = FakeClock(100.0)
    worker = Worker(stuck=frozenset({3}))
    bound_reads(worker, TransferDeadline(5.0, clock))
    worker._recving_transfers.update({"old": [1, 2], "stuck": [3, 4], "new": [5]})
    assert worker._pop_done_transfers(worker._recving_transfers) == (set(), set())
    worker._recving_transfers["newer"] = [6]
    clock.now += 6
    done, failed = worker._pop_done_transfers(worker._recving_transfers)
    assert (done, failed) == (set(), {"old", "stuck", "new"})
    assert sorted(worker.released) == [1, 2, 4, 5]
    # The handle whose release failed stays polled, as vLLM keeps one; the young read stays.
    assert worker._recving_transfers == {"stuck": [3], "newer": [6]}
    # Sends are polled through the same function and never expire here.
    sends = {"s": [9]}
    clock.now += 60
    assert worker._pop_done_transfers(sends) == (set(), set()) and sends == {"s": [9]}
