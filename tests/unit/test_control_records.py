"""Control-plane key layout and record JSON (pure, no Redis)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from control.keys import METRICS, POOLS, ControlKeys
from control.records import (
    DecisionRecord,
    PoolSLO,
    ReplicaBounds,
    decode_bounds,
    decode_decision,
    decode_pin,
    decode_replica_load,
    decode_slo,
    encode_bounds,
    encode_decision,
    encode_pin,
    encode_replica_load,
    encode_slo,
)
from engine.messages import ReplicaLoad


def make_load(**overrides: Any) -> ReplicaLoad:
    fields: dict[str, Any] = {
        "replica_id": "prefill-0",
        "pool": "prefill",
        "num_pending_prefill_tokens": 512,
        "num_running": 2,
        "num_waiting": 1,
        "kv_usage": 0.25,
        "num_total_blocks": 100,
        "num_free_blocks": 75,
        "updated_at": 1_700_000_000.5,
        "num_kv_loads": 9,
        "num_kv_load_failures": 2,
        "num_kv_recomputed_tokens": 300,
    }
    return ReplicaLoad(**(fields | overrides))


def make_decision(**overrides: Any) -> DecisionRecord:
    fields: dict[str, Any] = {
        "at": 1_700_000_000.0,
        "pool": "decode",
        "current_replicas": 2,
        "target_replicas": 3,
        "reason": "tpot p95 0.31s > slo 0.20s",
        "inputs": {"tpot_p95_s": 0.31, "kv_usage": 0.9},
    }
    return DecisionRecord(**(fields | overrides))


# Keys


def test_every_key_sits_under_the_app_namespace() -> None:
    keys = ControlKeys("demo.app-1_x")
    assert keys.namespace == "pdserve:demo.app-1_x:"
    assert keys.replicas("prefill") == "pdserve:demo.app-1_x:replicas:prefill"
    assert keys.prefix(b"\x00\xab") == "pdserve:demo.app-1_x:prefix:00ab"
    assert keys.samples("queue_wait") == "pdserve:demo.app-1_x:samples:queue_wait"
    assert keys.slo == "pdserve:demo.app-1_x:slo"
    assert keys.bounds("decode") == "pdserve:demo.app-1_x:bounds:decode"
    assert keys.pin("decode") == "pdserve:demo.app-1_x:pin:decode"
    assert keys.decisions == "pdserve:demo.app-1_x:decisions"


def test_keys_of_different_apps_and_pools_never_collide() -> None:
    every = []
    for app in ("a", "b"):
        keys = ControlKeys(app)
        every += [keys.slo, keys.decisions, keys.prefix(b"\x01")]
        every += [f(pool) for pool in POOLS for f in (keys.replicas, keys.bounds, keys.pin)]
        every += [keys.samples(metric) for metric in METRICS]
    assert len(every) == len(set(every))


@pytest.mark.parametrize("app", ["", "a:b", "a b", "{tag}", "ü", "a/b", "a\n"])
def test_bad_app_name_is_rejected(app: str) -> None:
    with pytest.raises(ValueError, match="app name"):
        ControlKeys(app)


def test_unknown_pool_metric_or_empty_hash_is_rejected() -> None:
    keys = ControlKeys("demo")
    for key_of in (keys.replicas, keys.bounds, keys.pin):
        with pytest.raises(ValueError, match="pool must be one of"):
            key_of("Prefill")
    with pytest.raises(ValueError, match="metric must be one of"):
        keys.samples("ttft_p95")
    with pytest.raises(ValueError, match="block hash"):
        keys.prefix(b"")


# Round trips


def test_replica_load_round_trip() -> None:
    load = make_load(pool="decode", kv_usage=1.0, num_free_blocks=0, updated_at=12)
    assert decode_replica_load(encode_replica_load(load)) == load
    assert decode_replica_load(encode_replica_load(load).encode()) == load
    dead = make_load(pool="decode", is_healthy=False)
    assert decode_replica_load(encode_replica_load(dead)).is_healthy is False
    older = json.loads(encode_replica_load(dead))
    del older["is_healthy"]  # written before the field existed
    assert decode_replica_load(json.dumps(older)).is_healthy is True
    with pytest.raises(ValueError, match="is_healthy"):
        decode_replica_load(json.dumps(older | {"is_healthy": "no"}))


def test_only_the_scaled_pools_publish_a_status() -> None:
    with pytest.raises(ValueError, match="pool must be one of"):
        encode_replica_load(make_load(pool="engine"))
    data = json.loads(encode_replica_load(make_load())) | {"pool": "router"}
    with pytest.raises(ValueError, match="pool must be one of"):
        decode_replica_load(json.dumps(data))


def test_decision_round_trip_copies_inputs() -> None:
    inputs = {"ttft_p95_s": 6.5, "queue_wait_s": 2}
    record = make_decision(pool="prefill", inputs=inputs)
    inputs["ttft_p95_s"] = 0.0
    assert record.inputs == {"ttft_p95_s": 6.5, "queue_wait_s": 2.0}
    assert decode_decision(encode_decision(record)) == record
    assert decode_decision(encode_decision(make_decision(inputs={}))).inputs == {}


def test_slo_bounds_and_pin_round_trip() -> None:
    slo = PoolSLO(ttft_p95_s=1.5, tpot_p95_s=0.05)
    bounds = ReplicaBounds(min_replicas=0, max_replicas=8)
    assert decode_slo(encode_slo(slo)) == slo
    assert decode_bounds(encode_bounds(bounds)) == bounds
    assert decode_pin(encode_pin(4)) == 4
    assert decode_pin(b"0") == 0


def test_unknown_fields_are_ignored_for_newer_writers() -> None:
    data = json.loads(encode_replica_load(make_load()))
    data["gpu_temperature_c"] = 71
    assert decode_replica_load(json.dumps(data)) == make_load()


# Validation


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"replica_id": ""}, "replica_id"),
        ({"pool": ""}, "pool"),
        ({"num_running": -1}, "num_running"),
        ({"num_waiting": -1}, "num_waiting"),
        ({"num_pending_prefill_tokens": -5}, "num_pending_prefill_tokens"),
        ({"num_free_blocks": -1}, "num_free_blocks"),
        ({"kv_usage": 1.01}, "kv_usage"),
        ({"kv_usage": -0.1}, "kv_usage"),
        ({"updated_at": float("nan")}, "updated_at"),
    ],
)
def test_bad_replica_load_is_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_load(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pool": "both"}, "pool"),
        ({"at": -1.0}, "at"),
        ({"current_replicas": -1}, "current_replicas"),
        ({"target_replicas": -2}, "target_replicas"),
    ],
)
def test_bad_decision_is_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_decision(**overrides)


def test_staleness_is_measured_against_the_given_clock() -> None:
    load = make_load(updated_at=100.0)
    assert load.is_fresh(now=130.0, max_age_s=30.0)
    assert not load.is_fresh(now=130.1, max_age_s=30.0)
    assert load.is_fresh(now=90.0, max_age_s=30.0)  # A reporter whose clock runs ahead.


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_total_blocks", 1.5, "'num_total_blocks' must be an integer"),
        ("num_running", True, "'num_running' must be an integer"),
        ("num_waiting", 1.5, "'num_waiting' must be an integer"),
        ("kv_usage", "0.5", "'kv_usage' must be a number"),
        ("replica_id", 7, "'replica_id' must be a string"),
    ],
)
def test_mistyped_status_field_is_named(field: str, value: object, message: str) -> None:
    data = json.loads(encode_replica_load(make_load()))
    data[field] = value
    with pytest.raises(ValueError, match=message):
        decode_replica_load(json.dumps(data))


def test_malformed_json_is_a_value_error() -> None:
    data = dataclasses.asdict(make_decision())
    del data["reason"]
    with pytest.raises(ValueError, match="missing field 'reason'"):
        decode_decision(json.dumps(data))
    with pytest.raises(ValueError, match="'inputs' must be an object"):
        decode_decision(json.dumps(data | {"reason": "x", "inputs": [1.0]}))
    with pytest.raises(ValueError, match="'kv_usage' must be a number"):
        decode_decision(json.dumps(data | {"reason": "x", "inputs": {"kv_usage": None}}))
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_replica_load("{oops")
    with pytest.raises(ValueError, match="expected a JSON object"):
        decode_slo("[1, 2]")
    with pytest.raises(ValueError, match="max_replicas"):
        decode_bounds('{"min_replicas": 4, "max_replicas": 2}')


@pytest.mark.parametrize("pin", [-1, True, 2.0])
def test_bad_pin_is_rejected_on_write(pin: Any) -> None:
    with pytest.raises(ValueError, match="pin must be an int"):
        encode_pin(pin)


@pytest.mark.parametrize("raw", ["", "-1", " 4", "+4", "4_0", "four", "٤"])
def test_bad_pin_is_rejected_on_read(raw: str) -> None:
    with pytest.raises(ValueError, match="pin"):
        decode_pin(raw)
