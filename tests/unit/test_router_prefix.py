"""Prompt block hashes and the in-memory prefix index (pure, fake clock)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix import NO_MATCH, MatchResult, PrefixIndex, block_hashes, match_owners
from tests.clock import FakeClock

BLOCK = 4
REPO = Path(__file__).resolve().parents[2]


def make_index(ttl_seconds: float = 60.0) -> tuple[PrefixIndex, FakeClock]:
    clock = FakeClock()
    return PrefixIndex(ttl_seconds, clock), clock


def prompt(num_tokens: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_tokens))


def test_hashes_are_pinned() -> None:
    # Computed once; a change here invalidates every prefix index already in Redis.
    assert [h.hex() for h in block_hashes(prompt(10), BLOCK)] == [
        "85f88946d23a58f3fa5a0c840f5399a1",
        "50190f9210a447e8f73858fde5edf5da",
    ]


def test_hashes_are_the_same_in_another_process() -> None:
    code = "from router.prefix import block_hashes; print(block_hashes(range(8), 4)[1].hex())"
    # Another hash seed: Python's own hash() would differ between the two processes.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=env
    ).stdout
    assert out.strip() == block_hashes(prompt(8), BLOCK)[1].hex()


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(prompt(3), BLOCK) == ()
    assert len(block_hashes(prompt(4), BLOCK)) == 1
    assert block_hashes(prompt(11), BLOCK) == block_hashes(prompt(8), BLOCK)
    assert len(block_hashes(prompt(12), BLOCK)) == 3


def test_one_changed_token_changes_its_block_and_all_later_ones() -> None:
    tokens = prompt(5 * BLOCK)
    base = block_hashes(tokens, BLOCK)
    for k in range(5):
        changed = list(tokens)
        changed[k * BLOCK + 2] += 1000
        hashes = block_hashes(changed, BLOCK)
        assert hashes[:k] == base[:k]
        assert all(hashes[i] != base[i] for i in range(k, 5))


def test_same_block_at_another_position_hashes_differently() -> None:
    a = block_hashes([7, 7, 7, 7, 7, 7, 7, 7], BLOCK)
    assert a[0] != a[1]


def test_salt_separates_namespaces() -> None:
    assert block_hashes(prompt(8), BLOCK, salt=b"model-a") != block_hashes(prompt(8), BLOCK)
    assert block_hashes(prompt(8), BLOCK, salt=b"a") != block_hashes(prompt(8), BLOCK, salt=b"b")


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(prompt(8), 0)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([1, 2, -3, 4], BLOCK)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([1, 2, 3, 2**32], BLOCK)


def test_match_owners_walks_from_block_zero() -> None:
    assert match_owners([]) == NO_MATCH
    assert match_owners([None, "a"]) == NO_MATCH
    assert match_owners(["a", "a", None, "a"]) == MatchResult("a", 2)
    assert match_owners(["a", "b", "b"]) == MatchResult("b", 3)
    assert match_owners(["a", "b", "b"], eligible={"a"}) == MatchResult("a", 1)
    assert match_owners(["a", "b"], eligible=set()) == NO_MATCH


def test_index_finds_the_longest_recorded_prefix() -> None:
    index, _ = make_index()
    shared = block_hashes(prompt(16), BLOCK)
    index.record(shared[:2], "r0")
    index.record(block_hashes(prompt(16, start=500), BLOCK), "r1")
    assert index.longest_prefix_match(shared) == MatchResult("r0", 2)
    assert index.longest_prefix_match(block_hashes(prompt(8, start=900), BLOCK)) == NO_MATCH
    assert index.longest_prefix_match(()) == NO_MATCH


def test_last_writer_wins_and_eligible_filters() -> None:
    index, _ = make_index()
    hashes = block_hashes(prompt(16), BLOCK)
    index.record(hashes[:2], "r0")
    index.record(hashes, "r1")
    assert index.longest_prefix_match(hashes) == MatchResult("r1", 4)
    assert index.longest_prefix_match(hashes, eligible={"r0"}) == NO_MATCH
    index.record(hashes[:1], "r0")
    assert index.longest_prefix_match(hashes, eligible={"r0", "r2"}) == MatchResult("r0", 1)


def test_entries_expire_after_the_ttl() -> None:
    index, clock = make_index(ttl_seconds=10)
    hashes = block_hashes(prompt(12), BLOCK)
    index.record(hashes, "r0")
    clock.now += 5
    index.record(hashes[:1], "r0")  # refreshes block 0 only
    clock.now += 5  # blocks 1, 2 reach their expiry
    assert index.longest_prefix_match(hashes) == MatchResult("r0", 1)
    # Block 1, met on the walk, is dropped; the walk stopped before block 2, the sweep takes it.
    assert len(index) == 2
    assert index.sweep_expired() == 1
    clock.now += 5
    assert index.longest_prefix_match(hashes) == NO_MATCH


def test_sweep_drops_only_expired_entries() -> None:
    index, clock = make_index(ttl_seconds=10)
    index.record(block_hashes(prompt(8), BLOCK), "r0")
    clock.now += 6
    index.record(block_hashes(prompt(8, start=100), BLOCK), "r1")
    clock.now += 4
    assert index.sweep_expired() == 2
    assert len(index) == 2
    with pytest.raises(ValueError, match="ttl_seconds"):
        PrefixIndex(0)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    block_size=st.integers(1, 8),
    cut=st.integers(0, 40),
)
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(
    tokens: list[int], block_size: int, cut: int
) -> None:
    full = block_hashes(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    assert block_hashes(tokens[:cut], block_size) == full[: min(cut, len(tokens)) // block_size]
