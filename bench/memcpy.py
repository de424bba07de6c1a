"""The floor a KV transfer is compared with: one plain copy of the same bytes in this process."""

from __future__ import annotations

import time

import numpy as np


def memcpy_seconds(num_bytes: int, repeats: int = 5) -> float:
    """Best-of-`repeats` time of np.copyto over `num_bytes` (pages touched beforehand)."""
    src = np.ones(max(num_bytes, 1), dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return best
