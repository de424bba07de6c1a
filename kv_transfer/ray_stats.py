"""Transfer telemetry of RayKVConnector, in the shape NIXL's stats use (seconds, bytes per
transfer), so one stat logger (engine/stats.py) and one benchmark read both backends.

A transfer here is one request's load on the consumer: fetch from the object store, crc32
check of every block, copy into the paged cache.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_KEYS = ("transfer_duration", "bytes_transferred", "num_failed_transfers")


@dataclass
class RayKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {key: [] for key in _KEYS}

    def record_transfer(self, seconds: float, num_bytes: int) -> None:
        self.data["transfer_duration"].append(seconds)
        self.data["bytes_transferred"].append(num_bytes)

    def record_failed_transfer(self) -> None:
        self.data["num_failed_transfers"].append(1)

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = sum(self.data["transfer_duration"])
        num_bytes = sum(self.data["bytes_transferred"])
        return {
            "Num successful transfers": len(self.data["transfer_duration"]),
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Total MB": num_bytes / 2**20,
            "Throughput (MB/s)": num_bytes / 2**20 / seconds if seconds else 0.0,
        }

    def clone_and_reset(self) -> RayKVConnectorStats:
        clone = RayKVConnectorStats(data=copy.deepcopy(self.data))
        self.reset()
        return clone
