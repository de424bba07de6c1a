"""Block and checksum arithmetic for moving one request's KV cache in whole blocks.

Pure: numpy and the standard library only, so the math is unit-tested in milliseconds.

    prompt tokens   0 ..................................................... N-1
    blocks          | block 0  | block 1  | block 2  | ... | block n-1 (partial) |
                     <-- bs -->                             n = ceil(N / bs)

The producer stores all n blocks of every layer (one array per layer, blocks on axis 0) and a
crc32 per (layer, block). A consumer may already hold a block-aligned prefix of the prompt in
its own prefix cache; it loads only the rest:

    consumer        | local 0  | local 1  | load 2   | ... | load n-1 |
                                 first_block = num_local_tokens / bs

The handoff digest hashes the whole checksum table, so the small handoff dict that travels
through the router carries an integrity value for every byte the consumer will copy.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import numpy as np


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partial)."""
    if num_tokens < 0 or block_size < 1:
        raise ValueError(f"need num_tokens >= 0, block_size >= 1; got {num_tokens}, {block_size}")
    return -(-num_tokens // block_size)


class LoadPlan(NamedTuple):
    """Which of the producer's blocks a consumer copies: [first_block, end_block)."""

    first_block: int
    end_block: int

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.first_block


def plan_load(num_tokens: int, num_local_tokens: int, block_size: int) -> LoadPlan:
    """Blocks to load when the consumer already computed `num_local_tokens` (block aligned)."""
    if num_local_tokens % block_size:
        raise ValueError(
            f"local prefix of {num_local_tokens} tokens is not a multiple of the block size "
            f"{block_size}"
        )
    if not 0 <= num_local_tokens < num_tokens:
        raise ValueError(f"local prefix {num_local_tokens} must lie in [0, {num_tokens})")
    return LoadPlan(num_local_tokens // block_size, num_blocks_for(num_tokens, block_size))


@dataclass(frozen=True)
class BlockLayout:
    """What a block of KV looks like in one engine's paged cache; producer and consumer must
    agree exactly. The connector checks it on every load; `handoff.KVLayout` is the model-level
    record (weights digest included) that the decode worker checks before asking for a load."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    # Shape of one block of one layer as the attention backend stores it, e.g. (H, N, C).
    block_shape: tuple[int, ...]
    # vLLM's physical layout name (e.g. "LBHNC"), or "" where the engine does not name one.
    cache_layout: str

    @property
    def block_nbytes(self) -> int:
        return int(np.prod(self.block_shape)) * _dtype_size(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["block_shape"] = list(self.block_shape)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> BlockLayout:
        missing = [f.name for f in fields(cls) if f.name not in raw]
        if missing:
            raise ValueError(f"KV layout lacks {', '.join(missing)}")
        try:
            return cls(
                num_layers=int(raw["num_layers"]),
                block_size=int(raw["block_size"]),
                num_kv_heads=int(raw["num_kv_heads"]),
                head_size=int(raw["head_size"]),
                dtype=str(raw["dtype"]),
                block_shape=tuple(int(d) for d in raw["block_shape"]),
                cache_layout=str(raw["cache_layout"]),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed KV layout {dict(raw)!r}: {exc}") from exc

    def describe_mismatch(self, other: BlockLayout) -> str | None:
        """None when equal, else 'field: here X, there Y; ...' naming every difference."""
        diffs = [
            f"{f.name}: here {getattr(self, f.name)!r}, producer {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "; ".join(diffs) or None


def _dtype_size(dtype: str) -> int:
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}
    name = dtype.removeprefix("torch.")
    if name in sizes:
        return sizes[name]
    if name.startswith("float8"):
        return 1
    raise ValueError(f"unknown KV dtype {dtype!r}")


def block_checksums(blocks: np.ndarray) -> list[int]:
    """crc32 of each block's bytes; blocks lie on axis 0 of a C-contiguous array."""
    if not blocks.flags.c_contiguous:
        raise ValueError("block_checksums needs a C-contiguous array")
    return [zlib.crc32(memoryview(blocks[i]).cast("B")) for i in range(blocks.shape[0])]


def corrupt_blocks(blocks: np.ndarray, expected: Sequence[int]) -> list[int]:
    """Indexes (along axis 0) of blocks whose crc32 differs from `expected`."""
    if len(expected) != blocks.shape[0]:
        raise ValueError(f"{blocks.shape[0]} blocks but {len(expected)} checksums")
    actual = block_checksums(blocks)
    return [i for i, (got, want) in enumerate(zip(actual, expected, strict=True)) if got != want]


def kv_digest(checksums: Sequence[Sequence[int]]) -> str:
    """sha256 over the (layers x blocks) checksum table, shape included."""
    table = np.asarray(checksums, dtype=np.uint32)
    if table.ndim != 2:
        raise ValueError(f"checksum table must be layers x blocks, got shape {table.shape}")
    hasher = hashlib.sha256(np.asarray(table.shape, dtype=np.int64).tobytes())
    hasher.update(table.tobytes())
    return hasher.hexdigest()


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Identifies the prompt a KV cache was computed for (KV of another prompt is useless)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]
