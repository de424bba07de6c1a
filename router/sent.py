"""What a request router sent each replica since that replica's last load report.

Loads come once per `router.stats_interval_s` (1 s). Between two reports every call of a burst
sees the same numbers, so a least-loaded choice sends the whole burst to one replica while the
other idles (two colocated engines at 4 req/s: the one chosen queues prompts it cannot prefill
before the next report). Each router adds what it sent a replica after that replica's report
to the report's numbers: the next call of the burst sees the first one's work. A report newer
than a send covers it (the replica either holds it in its numbers or has finished it), so the
send is dropped then; sends older than `horizon_s` are dropped whatever the reports say, so a
replica that stopped reporting does not carry them for ever.

Per router replica: each sees only its own sends, which is what it can know without asking.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable


class SentSinceReport:
    """Per replica id: (unix seconds sent, amount) of each call this router sent it."""

    def __init__(self, horizon_s: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self._horizon_s = horizon_s
        self._clock = clock
        self._sent: dict[str, collections.deque[tuple[float, int]]] = {}

    def __len__(self) -> int:
        """How many replicas it holds sends for."""
        return len(self._sent)

    def record(self, replica_id: str, amount: int) -> None:
        """A call carrying `amount` (prompt tokens, KV blocks) sent to `replica_id` now."""
        now = self._clock()
        # Replicas sent nothing within the horizon (gone ones too) are forgotten.
        for stale in [r for r, sent in self._sent.items() if sent[-1][0] <= now - self._horizon_s]:
            del self._sent[stale]
        self._sent.setdefault(replica_id, collections.deque()).append((now, amount))

    def since(self, replica_id: str, reported_at: float | None) -> tuple[int, int]:
        """(amount, calls) sent to `replica_id` after its report of `reported_at` (unix
        seconds; None: no report yet, so everything within the horizon)."""
        sent = self._sent.get(replica_id)
        if not sent:
            return 0, 0
        cutoff = max(reported_at or 0.0, self._clock() - self._horizon_s)
        while sent and sent[0][0] <= cutoff:
            sent.popleft()
        if not sent:
            del self._sent[replica_id]
            return 0, 0
        return sum(amount for _, amount in sent), len(sent)
