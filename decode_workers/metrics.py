"""The KV transfers a decode engine made, as Prometheus metrics through Ray's metrics agent
(`ray.util.metrics`), from its connector's own timing (NIXL's telemetry, the `ray` connector's).
The router's per-request metrics are in router/metrics.py.
"""

from __future__ import annotations

from engine.stats import KVLoadCounts, TransferSample

_SECONDS_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_BYTES_BOUNDARIES = [2**k for k in range(10, 34, 2)]


class TransferMetrics:
    """KV transfers one decode engine made, as its connector timed them, and what its loads
    came to (engine/stats.py: a load fails when the engine computed the prompt itself)."""

    def __init__(self, app: str, backend: str, pool: str = "decode") -> None:
        from ray.util.metrics import Counter, Histogram

        self._tags = {"app": app, "backend": backend}
        keys = ("app", "backend")
        self._load_tags = {"app": app, "pool": pool, "backend": backend}
        load_keys = ("app", "pool", "backend")
        self._loads_seen = KVLoadCounts()
        self.loads = Counter("pdserve_kv_loads_total", "KV loads a consumer made", load_keys)
        self.load_failures = Counter(
            "pdserve_kv_load_failures_total",
            "KV loads that did not deliver the prompt (recomputed or refused)",
            load_keys,
        )
        self.recomputed_tokens = Counter(
            "pdserve_kv_recomputed_tokens_total",
            "prompt tokens a consumer computed itself because their KV did not arrive",
            load_keys,
        )
        self.seconds = Histogram(
            "pdserve_kv_transfer_engine_seconds",
            "one KV transfer as the connector timed it",
            boundaries=_SECONDS_BOUNDARIES,
            tag_keys=keys,
        )
        self.bytes = Counter("pdserve_kv_transfer_bytes_total", "KV bytes pulled", tag_keys=keys)
        self.size = Histogram(
            "pdserve_kv_transfer_bytes",
            "bytes per transfer",
            boundaries=_BYTES_BOUNDARIES,
            tag_keys=keys,
        )
        # Export the load counters at 0 from the start, so a dashboard or alert on failures
        # reads 0 rather than "no data" until the first one (Ray's public `inc` refuses 0).
        for counter in (self.loads, self.load_failures, self.recomputed_tokens):
            counter._record(0, tags=self._load_tags)

    def observe_loads(self, total: KVLoadCounts) -> None:
        """Export the loads made since the last call (`total` is the engine's running count)."""
        new = total.minus(self._loads_seen)
        self._loads_seen = total
        for counter, value in (
            (self.loads, new.num_loads),
            (self.load_failures, new.num_failures),
            (self.recomputed_tokens, new.num_recomputed_tokens),
        ):
            if value > 0:
                counter.inc(value, tags=self._load_tags)

    def observe(self, samples: list[TransferSample]) -> None:
        for sample in samples:
            self.seconds.observe(sample.seconds, tags=self._tags)
            self.size.observe(sample.num_bytes, tags=self._tags)
            self.bytes.inc(sample.num_bytes, tags=self._tags)
