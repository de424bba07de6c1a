"""PrefillWorker: a vLLM AsyncLLM as KV producer.

`prefill` runs the prompt with max_tokens=1 and returns the first token and a KVHandoff. The
handoff owns the producer's KV until a decode worker pulls it (or releases it, or its lease
expires): whoever receives a PrefillResult must hand it to `DecodeWorker.decode` or
`DecodeWorker.release`.
"""

from __future__ import annotations

import time

from engine.async_engine import engine_times
from engine.messages import GenerationRequest, KVHandoff, KVTransferError, PrefillResult
from engine.sampling import to_sampling_params
from kv_transfer.endpoint import KVEndpoint


class PrefillWorker(KVEndpoint):
    role = "producer"
    id_prefix = "prefill"

    async def prefill(self, request: GenerationRequest) -> PrefillResult:
        if request.num_prompt_tokens >= self.settings.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the model's context is "
                f"{self.settings.max_model_len}"
            )
        sampling = to_sampling_params(
            request.params,
            max_tokens=1,
            kv_transfer_params=self.backend.producer_request_params(),
        )
        started = time.perf_counter()
        final = None
        async for output in self.engine.generate(
            {"prompt_token_ids": list(request.prompt_token_ids)}, sampling, request.request_id
        ):
            final = output
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
        return PrefillResult(handoff, finish_reason, compute_s, queue_s)
