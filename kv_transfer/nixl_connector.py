"""vLLM's NixlConnector, made a good neighbour on CPU hosts.

Loaded by vLLM in every engine process through `kv_connector_module_path`, so the fixes below
apply where the NIXL agent actually lives (the engine's worker child), before it starts:

- NIXL's progress thread busy-polls (`pthrDelay` is hard-coded to 0): each engine burned a
  whole core even idle and decode ran 2x slower beside it. We give it a 200 us poll delay.
- On CPU the connector's worker pins the calling thread to the last core of each NUMA node,
  which is the thread that runs the model: we put its affinity back.
- vLLM polls a read still in progress ("PROC") without limit: a producer that stops answering
  (a frozen process, a cut link) holds the request in WAITING_FOR_REMOTE_KVS for ever. A read
  older than `pd_transfer_timeout_s` (the connector's extra config) fails instead, and the
  engine's `kv_load_failure_policy` takes it (recompute: the decode engine prefills the prompt
  itself).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

PROGRESS_THREAD_DELAY_US = 200
TRANSFER_TIMEOUT_KEY = "pd_transfer_timeout_s"

logger = logging.getLogger(__name__)


class _BindingsWithPollDelay:
    """The NIXL bindings module, except that agents start with a non-zero progress delay."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = max(int(config.pthrDelay), self._delay_us)
        return self._bindings.nixlAgent(name, config)


def tame_progress_thread(delay_us: int = PROGRESS_THREAD_DELAY_US) -> None:
    import nixl._api

    # nixl resolves its CUDA-flavoured build at import; patch the module that agents come from.
    api = vars(sys.modules[nixl._api.nixl_agent.__module__])
    if not isinstance(api["nixlBind"], _BindingsWithPollDelay):
        api["nixlBind"] = _BindingsWithPollDelay(api["nixlBind"], delay_us)


class TransferDeadline:
    """When each request's reads began (first seen in flight), and which are past `timeout_s`."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._since: dict[str, float] = {}

    def expired(self, in_flight: Iterable[str]) -> list[str]:
        now = self._clock()
        current = set(in_flight)
        for req_id in list(self._since):
            if req_id not in current:
                del self._since[req_id]
        for req_id in current:
            self._since.setdefault(req_id, now)
        return [r for r, since in self._since.items() if now - since > self.timeout_s]


def bound_reads(worker: Any, deadline: TransferDeadline) -> None:
    """Wrap `worker._pop_done_transfers` (vLLM's poll of its reads, nixl/base_worker.py) so a
    read in flight past the deadline is failed as vLLM fails a read NIXL reports failed: its
    handles released (one whose release fails is kept, as vLLM keeps it) and the request
    listed failed, which `get_transfer_results` then finishes with a load error."""
    poll = worker._pop_done_transfers

    def pop_done_transfers(transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = poll(transfers)
        if transfers is not worker._recving_transfers:
            return done, failed
        for req_id in deadline.expired(transfers):
            handles = transfers.pop(req_id)
            logger.warning(
                "KV read of %s still in progress after %.0f s: failing it",
                req_id,
                deadline.timeout_s,
            )
            kept = [h for h in handles if not worker._handle_failed_transfer(req_id, h, failed)]
            if kept:
                transfers[req_id] = kept
        return done, failed

    worker._pop_done_transfers = pop_done_transfers


class PdNixlConnector(NixlConnector):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        tame_progress_thread()
        affinity = os.sched_getaffinity(0)
        try:
            super().__init__(vllm_config, *args, **kwargs)
        finally:
            os.sched_setaffinity(0, affinity)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        timeout_s = extra.get(TRANSFER_TIMEOUT_KEY)
        if timeout_s is not None and self.connector_worker is not None:
            bound_reads(self.connector_worker, TransferDeadline(float(timeout_s)))
