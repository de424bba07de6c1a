"""PrefillServer: the prefill pool's Serve deployment, one PrefillWorker per replica."""

from __future__ import annotations

from deploy.config import AppConfig
from deploy.engines import engine_settings, served_transfer_settings
from engine.replica import ReplicaShell, serve_replica_id
from engine.request import GenerationRequest
from prefill_workers.worker import PrefillResult, PrefillWorker


class PrefillServer(ReplicaShell):
    pool = "prefill"

    def __init__(self, config: AppConfig) -> None:
        worker = PrefillWorker(engine_settings(config, "prefill"), served_transfer_settings(config))
        worker.worker_id = f"prefill-{serve_replica_id(worker.worker_id)}"
        worker.start()
        self._engine_owner = worker
        self._stats = worker.stats
        self._num_pending_prefill_tokens = 0

    async def prefill(self, request: GenerationRequest) -> PrefillResult:
        self._num_pending_prefill_tokens += request.num_prompt_tokens
        try:
            result: PrefillResult = await self._engine_owner.prefill(request)
            return result
        finally:
            self._num_pending_prefill_tokens -= request.num_prompt_tokens
