"""Prometheus metrics through Ray's metrics agent (`ray.util.metrics`), exported on each node's
metrics port and scraped like any Ray metric. Names start with `pdserve_`.

The router records the per-request latencies and outcomes here; decode replicas record KV
transfer seconds and bytes from their engine's connector telemetry (decode_workers/metrics.py).
"""

from __future__ import annotations

from typing import Any

from router.timings import RequestTimings

_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class RouterMetrics:
    def __init__(self, app: str) -> None:
        from ray.util.metrics import Counter, Histogram

        tags = ("app",)

        def seconds(name: str, what: str) -> Any:
            return Histogram(
                f"pdserve_{name}_seconds", what, boundaries=_LATENCY_BOUNDARIES, tag_keys=tags
            )

        self._tags = {"app": app}
        self.ttft = seconds("ttft", "time to first token")
        self.tpot = seconds("tpot", "mean time per output token after the first")
        self.queue_wait = seconds("queue_wait", "arrival to prefill compute start")
        self.prefill = seconds("prefill", "prefill engine compute")
        self.kv_transfer = seconds("kv_transfer", "decode call to its first token (KV pull)")
        self.e2e = seconds("e2e", "arrival to last token")
        self.requests = Counter(
            "pdserve_requests_total", "requests by outcome", tag_keys=("app", "outcome")
        )
        self.migrations = Counter(
            "pdserve_migrations_total",
            "requests moved to other replicas after an engine, replica or transfer failed",
            tag_keys=tags,
        )
        # Exported at 0 from the start (a dashboard reads 0, not "no data", until the first
        # move); Ray's public `inc` refuses 0.
        self.migrations._record(0, tags=self._tags)
        self.decisions = Counter(
            "pdserve_pd_decisions_total",
            "new requests by where they were prefilled: local (decode replica) or remote",
            tag_keys=("app", "path"),
        )

    def count_decision(self, path: str) -> None:
        """A new request's prefill: "local" (on its decode replica) or "remote"."""
        self.decisions.inc(1, tags={**self._tags, "path": path})

    def count_migration(self) -> None:
        self.migrations.inc(1, tags=self._tags)

    def observe(self, outcome: str, timings: RequestTimings | None) -> None:
        self.requests.inc(1, tags={**self._tags, "outcome": outcome})
        if timings is None:
            return
        self.ttft.observe(timings.ttft_s, tags=self._tags)
        self.queue_wait.observe(timings.queue_wait_s, tags=self._tags)
        self.prefill.observe(timings.prefill_s, tags=self._tags)
        self.e2e.observe(timings.e2e_s, tags=self._tags)
        if timings.mean_tpot_s > 0:
            self.tpot.observe(timings.mean_tpot_s, tags=self._tags)
        if timings.decode_start_s > 0:
            self.kv_transfer.observe(timings.kv_transfer_s, tags=self._tags)
