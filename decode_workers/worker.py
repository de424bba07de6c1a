"""DecodeWorker: a vLLM AsyncLLM as KV consumer.

`decode` checks the handoff (digest, lease, layout), has vLLM pull the producer's KV, and streams
the tokens after the first one. vLLM recomputes the last prompt position on this side to get
logits, so the decode engine samples the first token again with the same seed: we check that
it equals the one prefill streamed, which catches a wrong KV cache before any further token.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

from engine.messages import (
    GenerationRequest,
    KVHandoff,
    KVHandshakeError,
    KVTransferError,
    TokenEvent,
)
from engine.sampling import logprobs_of, sampling_params_for
from kv_transfer.base import Role
from kv_transfer.endpoint import KVEndpoint
from prefill_workers.worker import PrefillWorker

logger = logging.getLogger(__name__)

# A release after a failed load is one notification to the producer; it must not hold the
# stream's end for long when the producer is why the load failed.
RELEASE_TIMEOUT_S = 5.0


class DecodeWorker(KVEndpoint):
    role: Role = "consumer"
    id_prefix = "decode"

    @property
    def release_is_idempotent(self) -> bool:
        """Whether releasing a handoff that decode may already have consumed is safe."""
        return self.backend.release_is_idempotent

    def check_handoff(self, handoff: KVHandoff) -> None:
        if handoff.backend != self.backend.name:
            raise KVHandshakeError(
                f"handoff uses backend {handoff.backend!r}, "
                f"this decode worker {self.backend.name!r}"
            )
        handoff.layout.check_compatible(self.layout)
        handoff.verify()

    async def decode(
        self, request: GenerationRequest, handoff: KVHandoff, avoid: frozenset[str] = frozenset()
    ) -> AsyncIterator[TokenEvent]:
        """Stream the tokens after `handoff.first_token`. Raises KVHandshakeError before any
        transfer when the producer's layout differs, KVTransferError when the KV is bad.
        (`avoid`, the replicas a moved request failed on, concerns only pools of several.)"""
        # Refused before any transfer; the producer's lease stays with the caller to release
        # through a compatible decode worker, or to expire.
        self.check_handoff(handoff)
        sampling = sampling_params_for(
            self.engine,
            request.params,
            kv_transfer_params=self.backend.consumer_request_params(handoff.pull),
            served=True,
        )
        first_seen = False  # the token decode samples again, checked then dropped
        load_recorded = named = load_failed = False
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": list(request.prompt_token_ids)}, sampling, request.request_id
            ):
                completion = output.outputs[0]
                new_ids = [int(t) for t in completion.token_ids]  # delta outputs: the new ids
                logprobs = logprobs_of(completion, request.params)
                if not load_recorded:
                    # The first output settles the load: vLLM counts the prompt tokens it did not
                    # compute (loaded from the producer, or prefix-cached here).
                    load_failed = self.stats.record_kv_load(
                        request.num_prompt_tokens,
                        int(output.num_cached_tokens or 0),
                        failed=completion.finish_reason == "error",
                    )
                    load_recorded = True
                if not first_seen and new_ids:
                    if new_ids[0] != handoff.first_token:
                        await self.engine.abort(request.request_id)
                        raise KVTransferError(
                            f"decode of {request.request_id} re-sampled first token {new_ids[0]}, "
                            f"prefill sent {handoff.first_token}: refusing to continue"
                        )
                    new_ids = new_ids[1:]
                    logprobs = logprobs[1:] if logprobs is not None else None
                    first_seen = True
                if new_ids or completion.finish_reason is not None:
                    # The first event names this replica (router timings show who decoded).
                    replica_id = "" if named else self.worker_id
                    named = True
                    yield TokenEvent(
                        tuple(new_ids),
                        completion.finish_reason,
                        replica_id=replica_id,
                        logprobs=logprobs,
                    )
        finally:
            if load_failed:
                await self._release_after_failed_load(handoff)

    async def _release_after_failed_load(self, handoff: KVHandoff) -> None:
        """The load failed (past its deadline, a bad read) and decode recomputed the prompt:
        the producer still holds KV nobody will read. Freed now rather than at its lease."""
        try:
            await asyncio.wait_for(self.release(handoff), RELEASE_TIMEOUT_S)
        except Exception as exc:
            logger.warning(
                "releasing the KV of %s after its failed load: %s; it expires with its lease",
                handoff.request_id,
                exc,
            )

    async def release(self, handoff: KVHandoff) -> None:
        """Give up a handoff without decoding it: the producer's KV is freed now, not at expiry."""
        await self.engine.notify_kv_transfer_request_rejected(
            f"release-{handoff.request_id}-{uuid.uuid4().hex[:6]}",
            self.backend.rejection_params(handoff.pull),
        )


class EngineWorker(DecodeWorker, PrefillWorker):
    """An engine of KV role "both": it prefills for others (`prefill`, a KV producer), decodes
    what others prefilled (`decode`, a consumer) and serves whole requests (`generate`), all on
    one loaded model. Every served engine of the disaggregated app is one, so which pool's work
    an engine does is a routing choice (a role flip, router/roles.py), not a restart."""

    role: Role = "both"
    id_prefix = "engine"
