"""Block arithmetic, checksums, digests and the ray backend's handoff schema (pure, ms)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.blocks import (
    BlockLayout,
    block_checksums,
    corrupt_blocks,
    kv_digest,
    num_blocks_for,
    plan_load,
    prompt_digest,
)
from kv_transfer.leases import lease_owner, make_lease_key
from kv_transfer.ray_params import RayKVHandoff, RayKVSettings, consumer_params

LAYOUT = BlockLayout(
    num_layers=4,
    block_size=32,
    num_kv_heads=2,
    head_size=32,
    dtype="float32",
    block_shape=(2, 32, 64),
    cache_layout="LBHNC",
)


def make_handoff(**overrides: object) -> RayKVHandoff:
    fields: dict[str, object] = {
        "key": "P/r1/abc",
        "producer_id": "P",
        "num_tokens": 97,
        "block_size": 32,
        "num_blocks": 4,
        "expires_at": 1e9,
        "digest": "d" * 64,
        "prompt_digest": "p" * 32,
        "layout": LAYOUT,
    }
    fields.update(overrides)
    return RayKVHandoff(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(0, 0), (1, 1), (31, 1), (32, 1), (33, 2), (64, 2), (1500, 47)]
)
def test_num_blocks_for(num_tokens: int, expected: int) -> None:
    assert num_blocks_for(num_tokens, 32) == expected


def test_plan_load_skips_the_consumers_local_prefix() -> None:
    assert plan_load(97, 0, 32) == (0, 4)
    assert plan_load(97, 64, 32) == (2, 4)
    assert plan_load(97, 64, 32).num_blocks == 2
    assert plan_load(1, 0, 32) == (0, 1)


@pytest.mark.parametrize(("num_tokens", "num_local"), [(97, 40), (64, 64), (64, 96), (10, -32)])
def test_plan_load_rejects_bad_local_prefix(num_tokens: int, num_local: int) -> None:
    with pytest.raises(ValueError):
        plan_load(num_tokens, num_local, 32)


def test_checksums_find_exactly_the_altered_block() -> None:
    blocks = np.arange(4 * 256, dtype=np.uint8).reshape(4, 256).copy()
    sums = block_checksums(blocks)
    assert len(sums) == 4 and corrupt_blocks(blocks, sums) == []
    blocks[2, 17] ^= 1
    assert corrupt_blocks(blocks, sums) == [2]


def test_checksums_need_contiguous_blocks_and_one_sum_per_block() -> None:
    blocks = np.zeros((4, 8), dtype=np.uint8)
    with pytest.raises(ValueError):
        block_checksums(blocks[:, ::2])
    with pytest.raises(ValueError):
        corrupt_blocks(blocks, [0, 0, 0])


def test_digest_covers_every_checksum_and_the_table_shape() -> None:
    table = [[1, 2, 3], [4, 5, 6]]
    assert kv_digest(table) == kv_digest([[1, 2, 3], [4, 5, 6]])
    assert kv_digest(table) != kv_digest([[1, 2, 3], [4, 5, 7]])
    assert kv_digest([[1, 2], [3, 4]]) != kv_digest([[1, 2, 3, 4]])
    with pytest.raises(ValueError):
        kv_digest([1, 2, 3])  # type: ignore[list-item]


def test_prompt_digest_tells_prompts_apart() -> None:
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3))
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2])


def test_layout_mismatch_names_every_differing_field() -> None:
    assert LAYOUT.describe_mismatch(LAYOUT) is None
    other = BlockLayout.from_dict({**LAYOUT.to_dict(), "dtype": "bfloat16", "block_size": 64})
    message = LAYOUT.describe_mismatch(other)
    assert message is not None
    assert "dtype: here 'float32', producer 'bfloat16'" in message
    assert "block_size: here 32, producer 64" in message
    assert LAYOUT.block_nbytes == 2 * 32 * 64 * 4


def test_layout_round_trips_and_rejects_missing_fields() -> None:
    assert BlockLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    raw = LAYOUT.to_dict()
    del raw["head_size"]
    with pytest.raises(ValueError, match="head_size"):
        BlockLayout.from_dict(raw)


def test_handoff_round_trips_through_plain_json_types() -> None:
    import json

    handoff = make_handoff()
    raw = json.loads(json.dumps(handoff.to_dict()))
    assert RayKVHandoff.from_dict(raw) == handoff
    assert handoff.with_expiry(5.0).expires_at == 5.0
    assert consumer_params({"ray_kv": raw}) == {"do_remote_prefill": True, "ray_kv": raw}


@pytest.mark.parametrize(
    "raw",
    [None, "key", {"key": "k"}, {**make_handoff().to_dict(), "num_blocks": 3}],
    ids=["none", "string", "partial", "wrong-block-count"],
)
def test_handoff_rejects_malformed_dicts(raw: object) -> None:
    with pytest.raises(ValueError):
        RayKVHandoff.from_dict(raw)


def test_settings_validate_the_extra_config() -> None:
    settings = RayKVSettings.from_extra_config(
        {"lease_registry": "leases", "ray_address": "10.0.0.1:6379", "lease_seconds": 5}
    )
    assert settings.lease_seconds == 5.0 and settings.ray_namespace is None
    with pytest.raises(ValueError, match="lease_registry"):
        RayKVSettings.from_extra_config({})
    with pytest.raises(ValueError, match="unknown"):
        RayKVSettings.from_extra_config({"lease_registry": "x", "lease_secs": 5})
    with pytest.raises(ValueError, match="positive"):
        RayKVSettings.from_extra_config({"lease_registry": "x", "lease_seconds": 0})


def test_lease_keys_are_unique_per_call() -> None:
    first, second = make_lease_key("P/r1"), make_lease_key("P/r1")
    assert first != second and first.startswith("P/r1/")
    assert lease_owner(first) == lease_owner(second) == "P/r1"
