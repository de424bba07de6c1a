"""Role flip time on a running app: a decode replica flipped to the prefill pool's calls and
back, `n` flips in all, each timed from its write until every live router applied it
(deploy/cli_ops.py `flip_role`). `pdserve bench run` measures it for each disaggregated system
after its load, and the report shows the P50 (issue 16)."""

from __future__ import annotations

from typing import Any

from control.sync_store import SyncControlStore
from deploy.cli_ops import flip_role
from engine.autoscaling_stats import percentile_of


def measure_role_flips(redis_url: str, app: str, n: int = 10) -> dict[str, Any]:
    """{"n", "p50_s", "p95_s", "max_s", "num_routers", "replica"}; the replica ends in its
    own pool's role."""
    with SyncControlStore.connect(redis_url, app) as store:
        decodes = store.replica_ids("decode")
        if not decodes:
            raise ValueError(f"{app}: no decode replica has reported")
        replica = decodes[0]
        seconds, routers = [], set()
        try:
            for i in range(n):
                flip = flip_role(store, replica, "prefill" if i % 2 == 0 else "decode")
                seconds.append(flip.seconds)
                routers.add(flip.num_routers)
        finally:
            if store.role_table().role_of(replica) != "decode":
                flip_role(store, replica, "decode")
    return {
        "n": n,
        "p50_s": percentile_of(seconds, 50),
        "p95_s": percentile_of(seconds, 95),
        "max_s": max(seconds),
        "num_routers": min(routers),
        "replica": replica,
    }
