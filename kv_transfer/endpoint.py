"""KVEndpoint: a served vLLM engine at one end of the KV transfer, producer or consumer.

What the prefill and decode workers share: the engine's settings and transfer backend, its
KVLayout for the handshake, starting the AsyncLLM with the role's connector, stats, aborting,
the strict idle check and shutdown. The workers add their half of the request lifecycle.
"""

from __future__ import annotations

import uuid
from typing import Any

from engine.async_engine import kv_cache_is_empty, start_async_engine
from engine.settings import EngineSettings
from engine.stats import EngineStatsRecorder
from kv_transfer.base import Role, TransferSettings, make_backend
from kv_transfer.layout import kv_layout_for


class KVEndpoint:
    role: Role
    id_prefix: str

    def __init__(
        self, settings: EngineSettings, transfer: TransferSettings, worker_id: str | None = None
    ) -> None:
        self.settings = settings
        self.transfer = transfer
        self.backend = make_backend(transfer)
        self.worker_id = worker_id or f"{self.id_prefix}-{uuid.uuid4().hex[:8]}"
        self.layout = kv_layout_for(settings)
        self.engine: Any = None
        self.start_seconds = 0.0
        self.stats = EngineStatsRecorder()

    def start(self) -> None:
        self.engine, self.start_seconds = start_async_engine(
            self.settings,
            self.backend.transfer_config(self.worker_id, self.role),
            self.backend.process_env(),
            self.stats,
        )

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def is_idle(self) -> bool:
        """True when the engine holds no KV block (strict, fresh; see kv_cache_is_empty)."""
        return await kv_cache_is_empty(self.engine)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
