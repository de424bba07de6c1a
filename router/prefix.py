"""Prefix-cache affinity: block hashes of a prompt, and which prefill replica last computed them.

Hashes chain like vLLM's prefix caching, one per *full* block; the partial tail is not hashed
(no replica caches it as a reusable block):

    token ids   | t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49 |
    hashes      |    h0     |     h1     |     h2     |  (none) |
                 h0 = H(root, block 0);  h_k = H(h_{k-1}, block k)

So h_k stands for the whole prefix of k+1 blocks: one changed token in block k changes
h_k, h_{k+1}, ... but never h_0 .. h_{k-1}. H is blake2b over little-endian uint32 token ids,
the same in every process and on every machine (Python's `hash()` is salted per process).

`PrefixIndex` is the in-memory model of the index; the Redis-backed one shared by router
replicas implements the same `PrefixLookup` interface and reuses `match_owners`.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple, Protocol

BlockHash = bytes
HASH_BYTES = 16
_PERSON = b"pdserve-prefix"
_MAX_TOKEN_ID = 2**32 - 1


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, salt: bytes = b""
) -> tuple[BlockHash, ...]:
    """One chained hash per full block of `token_ids`. `salt` separates namespaces (a model,
    an adapter) whose equal token ids must not share cache entries."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = _digest(b"root", salt)
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        if any(not 0 <= token <= _MAX_TOKEN_ID for token in block):
            raise ValueError(f"token ids must be in [0, {_MAX_TOKEN_ID}], got block {block!r}")
        parent = _digest(parent, struct.pack(f"<{block_size}I", *block))
        hashes.append(parent)
    return tuple(hashes)


def _digest(*parts: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON)
    for part in parts:
        # Length-prefixed, so (b"ab", b"c") and (b"a", b"bc") differ.
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


class MatchResult(NamedTuple):
    """The replica holding the longest cached prefix; `replica` is None when nothing matched."""

    replica: str | None
    num_blocks: int


NO_MATCH = MatchResult(None, 0)


class PrefixLookup(Protocol):
    """What the router needs from a prefix index (in-memory here, Redis in a deployment)."""

    def longest_prefix_match(
        self, hashes: Sequence[BlockHash], eligible: Collection[str] | None = None
    ) -> MatchResult:
        """Longest run of `hashes`, from block 0, whose last block an eligible replica owns."""
        ...

    def record(self, hashes: Sequence[BlockHash], replica: str) -> None:
        """`replica` has just computed these blocks: it owns them for the next TTL."""
        ...


def match_owners(
    owners: Sequence[str | None], eligible: Collection[str] | None = None
) -> MatchResult:
    """Given the live owner of each prompt block in order (None: unknown or expired), the
    longest prefix an eligible replica holds. Because hashes chain, the owner of block k
    computed blocks 0..k too; the walk stops at the first unknown block."""
    best = NO_MATCH
    for index, owner in enumerate(owners):
        if owner is None:
            break
        if eligible is None or owner in eligible:
            best = MatchResult(owner, index + 1)
    return best


class _Entry(NamedTuple):
    replica: str
    expires_at: float


class PrefixIndex:
    """block hash -> the replica that last computed it, each entry alive for `ttl_seconds`.

    Last writer wins: the newest replica to prefill a prefix is the likeliest to still cache it.
    Expired entries are dropped when met and by `sweep_expired`.
    """

    def __init__(self, ttl_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds}")
        self._ttl_seconds = ttl_seconds
        self._clock = clock
        self._entries: dict[BlockHash, _Entry] = {}

    def record(self, hashes: Sequence[BlockHash], replica: str) -> None:
        expires_at = self._clock() + self._ttl_seconds
        for block_hash in hashes:
            self._entries[block_hash] = _Entry(replica, expires_at)

    def longest_prefix_match(
        self, hashes: Sequence[BlockHash], eligible: Collection[str] | None = None
    ) -> MatchResult:
        now = self._clock()
        owners: list[str | None] = []
        for block_hash in hashes:
            owner = self._live_owner(block_hash, now)
            owners.append(owner)
            if owner is None:
                break
        return match_owners(owners, eligible)

    def sweep_expired(self) -> int:
        """Drop every expired entry; returns how many went."""
        now = self._clock()
        expired = [h for h, entry in self._entries.items() if entry.expires_at <= now]
        for block_hash in expired:
            del self._entries[block_hash]
        return len(expired)

    def __len__(self) -> int:
        return len(self._entries)

    def _live_owner(self, block_hash: BlockHash, now: float) -> str | None:
        entry = self._entries.get(block_hash)
        if entry is None:
            return None
        if entry.expires_at <= now:
            del self._entries[block_hash]
            return None
        return entry.replica
