"""The records that cross a process boundary (engine/messages.py): the handoff's digest and
handshake, the prefill result, Serve's routing stats as a typed ReplicaLoad."""

from __future__ import annotations

import json
import pickle
import time
from dataclasses import replace

import pytest

from engine.messages import (
    KVHandoff,
    KVHandshakeError,
    KVLayout,
    KVTransferError,
    NixlPull,
    PrefillResult,
    RayPull,
    ReplicaLoad,
)

LAYOUT = KVLayout("tiny", "abc123", "float32", 32, 4, 2, 32)
NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "prefill-1",
    "remote_request_id": "r1",
    "remote_host": "localhost",
    "remote_port": 5601,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 70,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def make_handoff(**overrides: object) -> KVHandoff:
    fields: dict[str, object] = {
        "backend": "nixl",
        "producer_id": "prefill-1",
        "request_id": "r1",
        "num_prompt_tokens": 70,
        "first_token": 42,
        "layout": LAYOUT,
        "lease_expires_at": time.time() + 60,
        "pull": NixlPull.from_producer_params(NIXL_PARAMS),
    }
    fields.update(overrides)
    return KVHandoff(**fields)  # type: ignore[arg-type]


def test_nixl_params_round_trip() -> None:
    pull = NixlPull.from_producer_params(NIXL_PARAMS)
    assert pull.num_blocks == 3
    assert pull.to_consumer_params(flat_blocks=False) == NIXL_PARAMS
    flat = NixlPull.from_producer_params({**NIXL_PARAMS, "remote_block_ids": [3, 4, 5]})
    assert flat == pull


def test_ray_pull_keeps_params_whole() -> None:
    params = {"key": "k", "num_blocks": 2, "digest": "d", "layout": {"block_size": 32}}
    assert RayPull.from_producer_params(params).params == params


def test_handoff_survives_pickle_and_verifies() -> None:
    handoff = make_handoff()
    again = pickle.loads(pickle.dumps(handoff))
    assert again == handoff
    again.verify()


def test_altered_handoff_fails_digest() -> None:
    handoff = make_handoff()
    tampered = replace(handoff, first_token=7, digest=handoff.digest)
    with pytest.raises(KVTransferError, match="digest"):
        tampered.verify()


def test_expired_lease_is_refused() -> None:
    handoff = make_handoff(lease_expires_at=time.time() - 5)
    with pytest.raises(KVTransferError, match="expired"):
        handoff.verify()


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 64), ("dtype", "bfloat16"), ("weights_digest", "zzz"), ("num_layers", 5)],
)
def test_layout_mismatch_names_the_field(field: str, value: object) -> None:
    other = replace(LAYOUT, **{field: value})
    with pytest.raises(KVHandshakeError, match=field):
        LAYOUT.check_compatible(other)
    LAYOUT.check_compatible(replace(LAYOUT))


def test_digest_is_stable_and_covers_every_field() -> None:
    handoff = make_handoff(lease_expires_at=1_000.0)
    # A fixed record hashes to a fixed value, in any process and on any build: producer and
    # consumer compute it separately, so a change of the digested form must show here first.
    assert handoff.digest == "e91bc6e4d7a39813bc0590d351712e1b"
    changed = {
        "backend": "ray",
        "producer_id": "prefill-2",
        "request_id": "r2",
        "num_prompt_tokens": 71,
        "first_token": 43,
        "layout": replace(LAYOUT, block_size=64),
        "lease_expires_at": 1_000.5,
        "pull": replace(handoff.pull, remote_port=1),
    }
    for field, value in changed.items():
        assert replace(handoff, **{field: value}, digest="").digest != handoff.digest, field
    json.dumps(handoff.pull.to_consumer_params(flat_blocks=True))  # type: ignore[union-attr]


def test_kv_bytes_per_token_of_the_default_model() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads, head size 64 (FIELD-NOTES): 46,080 bytes per token
    # in float32, 23,040 in bfloat16 (the ~23 KB NIXL measured per bf16 token).
    default = replace(LAYOUT, num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    assert default.bytes_per_token == 46_080
    assert replace(default, dtype="bfloat16").bytes_per_token == 23_040


def test_the_first_token_is_stored_once_in_the_handoff() -> None:
    result = PrefillResult(make_handoff(first_token=7), None, prefill_seconds=0.1)
    assert result.first_token == 7
    assert pickle.loads(pickle.dumps(result)) == result


LOAD = ReplicaLoad(
    replica_id="decode-ab12",
    pool="decode",
    num_pending_prefill_tokens=0,
    num_running=3,
    num_waiting=1,
    kv_usage=0.5,
    num_total_blocks=64,
    num_free_blocks=32,
    updated_at=1_700_000_000.0,
)


def test_replica_load_crosses_serve_as_a_dict_and_back() -> None:
    stats = LOAD.to_stats()
    assert isinstance(stats, dict) and stats["num_free_blocks"] == 32
    assert ReplicaLoad.from_stats(stats) == LOAD


def test_a_replica_that_has_not_reported_has_no_load() -> None:
    assert ReplicaLoad.from_stats({}) is None
    assert ReplicaLoad.from_stats(None) is None


def test_incomplete_routing_stats_name_the_missing_field() -> None:
    stats = LOAD.to_stats()
    del stats["num_total_blocks"]
    with pytest.raises(ValueError, match="num_total_blocks"):
        ReplicaLoad.from_stats(stats)
