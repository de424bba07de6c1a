"""The sim engine's KV block pool with prefix caching, as vLLM's block manager keeps it.

A request's blocks cover its computed tokens. A full block is registered under the hash of its
tokens chained to the blocks before it, so an equal prefix is found again; a block nobody uses
goes to the free list and keeps its hash until it is taken for new tokens (least recently freed
first), so a cache hit can revive it:

    tokens   [t0 .. t31][t32 .. t63][t64 .. t70]
    blocks   [   b7    ][   b2     ][   b9    ]   b9 not full: not cached
    hashes   h0=H(-,b7) h1=H(h0,b2)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        hashes.append(previous)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Unreferenced blocks, least recently freed first; some still carry a cached hash.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._refs: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # hash -> block
        self._hash_of: dict[int, int] = {}  # block -> hash

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (not yet referenced)."""
        found = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def take(self, blocks: Sequence[int]) -> None:
        """Reference blocks found by `match_prefix`."""
        for block in blocks:
            self._refs[block] = self._refs.get(block, 0) + 1
            self._free.pop(block, None)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._cached[old]
            self._refs[block] = 1
            taken.append(block)
        return taken

    def register(self, block: int, block_hash: int) -> None:
        """Cache a full block under its chained hash (a block already cached keeps its own)."""
        if block_hash in self._cached or block in self._hash_of:
            return
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash

    def free(self, blocks: Sequence[int]) -> None:
        # Freed in reverse so a request's tail is reused before its (more shareable) head.
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
            else:
                del self._refs[block]
                self._free[block] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, as vLLM does."""
        if self._refs:
            return False
        self._cached.clear()
        self._hash_of.clear()
        return True
