"""PrefillWorker: a vLLM AsyncLLM as KV producer.

`prefill` runs the prompt with max_tokens=1 and returns the first token and a KVHandoff. The
handoff owns the producer's KV until a decode worker pulls it (or releases it, or its lease
expires): whoever receives a PrefillResult must hand it to `DecodeWorker.decode` or
`DecodeWorker.release`.
"""

from __future__ import annotations

import time
import uuid

from engine.async_engine import engine_times
from engine.messages import GenerationRequest, KVHandoff, KVTransferError, PrefillResult
from engine.sampling import logprobs_of, sampling_params_for
from engine.settings import EngineSettings
from kv_transfer.base import Role, TransferSettings
from kv_transfer.endpoint import KVEndpoint


class PrefillWorker(KVEndpoint):
    role: Role = "producer"
    id_prefix = "prefill"

    def __init__(
        self, settings: EngineSettings, transfer: TransferSettings, worker_id: str | None = None
    ) -> None:
        super().__init__(settings, transfer, worker_id)
        # request id -> the attempt id its running prefill stores KV under: an abort releases
        # that attempt's store only, never a later retry of the same request id.
        self._attempts: dict[str, str] = {}

    async def prefill(
        self, request: GenerationRequest, avoid: frozenset[str] = frozenset()
    ) -> PrefillResult:
        """The prompt's first token and its KV's handoff. (`avoid`, the replicas a moved
        request failed on, concerns only pools of several.)"""
        if request.num_prompt_tokens >= self.settings.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the model's context is "
                f"{self.settings.max_model_len}"
            )
        attempt = f"{request.request_id}:{uuid.uuid4().hex[:8]}"
        sampling = sampling_params_for(
            self.engine,
            request.params,
            max_tokens=1,
            kv_transfer_params=self.backend.producer_request_params(self.worker_id, attempt),
            served=True,
        )
        self._attempts[request.request_id] = attempt
        started = time.perf_counter()
        final = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": list(request.prompt_token_ids)}, sampling, request.request_id
            ):
                final = output
        finally:
            self._attempts.pop(request.request_id, None)
        elapsed = time.perf_counter() - started
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            raise KVTransferError(f"prefill of {request.request_id} produced no token")
        params = final.kv_transfer_params
        if not params:
            raise KVTransferError(
                f"prefill of {request.request_id} returned no KV transfer parameters"
            )
        completion = final.outputs[0]
        first_token = int(completion.token_ids[0])
        finish_reason = completion.finish_reason
        if finish_reason == "length" and request.params.max_tokens > 1:
            finish_reason = None  # capped by us at one token, not by the client
        handoff = KVHandoff(
            backend=self.backend.name,
            producer_id=self.worker_id,
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            first_token=first_token,
            layout=self.layout,
            lease_expires_at=time.time() + self.transfer.lease_seconds,
            pull=self.backend.parse_producer_output(params),
        )
        queue_s, compute_s = engine_times(final.metrics, elapsed)
        logprobs = logprobs_of(completion, request.params)
        first_logprobs = logprobs[0] if logprobs else None
        return PrefillResult(handoff, finish_reason, compute_s, queue_s, first_logprobs)

    async def abort(self, request_id: str) -> None:
        """Stop the prefill; if the engine stored its KV all the same (it finished just as the
        abort came), that store is released, since its handoff will never reach anyone."""
        attempt = self._attempts.get(request_id)
        await super().abort(request_id)
        if attempt is not None:
            await self.backend.release_abandoned(self.worker_id, attempt)

    async def is_drained(self) -> bool:
        """No KV block held and no handoff stored outside the engine (the `ray` backend's
        objects live as long as this process) still waiting to be pulled."""
        return await self.is_idle() and await self.backend.num_stored_handoffs(self.worker_id) == 0
