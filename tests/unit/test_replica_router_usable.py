"""Which replicas the request routers consider: not those whose engine died, nor those a moved
request already failed on; all of them when that leaves none."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from engine.messages import ReplicaLoad
from router.replica_router import _loads, _usable

LOAD = ReplicaLoad("decode-a", "decode", 0, 0, 0, 0.0, 100, 100, 1.0)


def replica(unique_id: str, healthy: bool | None = True) -> Any:
    """A RunningReplica as the routers read it: its id and its last routing stats (None: it
    has not reported yet)."""
    stats = None if healthy is None else replace(LOAD, is_healthy=healthy).to_stats()
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id), routing_stats=stats)


def pending(*avoid: str) -> Any:
    return SimpleNamespace(args=[], kwargs={"avoid": avoid} if avoid else {})


def usable(replicas: list[Any], pending: Any) -> list[Any]:
    return _usable(replicas, _loads(replicas), pending)


def ids(replicas: list[Any]) -> list[str]:
    return [r.replica_id.unique_id for r in replicas]


def test_a_replica_whose_engine_died_is_skipped() -> None:
    replicas = [replica("a", healthy=False), replica("b"), replica("c", healthy=None)]
    assert ids(usable(replicas, pending())) == ["b", "c"]


def test_replicas_the_request_failed_on_are_skipped() -> None:
    replicas = [replica("a"), replica("b"), replica("c")]
    assert ids(usable(replicas, pending("decode-a", "prefill-c"))) == ["b"]


def test_when_none_is_left_all_are_tried() -> None:
    replicas = [replica("a", healthy=False), replica("b")]
    assert ids(usable(replicas, pending("decode-b"))) == ["a", "b"]
    assert ids(usable(replicas, None)) == ["b"]
