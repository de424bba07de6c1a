"""Scheduler side of RayKVConnector: decides what to save and load; never touches KV data.

Producer (`do_remote_decode`): on the step that completes a request's prompt, ask the worker to
store the prompt's blocks under a fresh lease key; when the request finishes, return the handoff
that the registry now holds. Blocks are freed at once: the KV lives on in the object store.

Consumer (`do_remote_prefill`): claim every prompt token as loadable, asynchronously (as vLLM's
NIXL flow does). The scheduler parks the request in WAITING_FOR_REMOTE_KVS, the worker loads and
verifies, and after a good load vLLM recomputes only the last prompt token to get the logits for
the first output token. A failed load goes through vLLM's kv_load_failure_policy. Each request
gets one load attempt; a request that finishes without one releases its lease here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray

from kv_transfer.blocks import num_blocks_for, plan_load, prompt_digest
from kv_transfer.leases import make_lease_key
from kv_transfer.ray_metadata import LoadRequest, RayKVConnectorMetadata, SaveRequest
from kv_transfer.ray_params import (
    HANDOFF_PARAM,
    LOAD_STATUS_PARAM,
    OWNER_PARAM,
    LoadStatus,
    RayKVHandoff,
    RayKVSettings,
    lease_owner_id,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _params(request: Request) -> dict[str, Any]:
    return request.kv_transfer_params or {}


class RayKVScheduler:
    def __init__(
        self, settings: RayKVSettings, engine_id: str, block_size: int, registry: Any
    ) -> None:
        self._settings = settings
        self._engine_id = engine_id
        self._block_size = block_size
        self._registry = registry
        self._kv_cache_manager: KVCacheManager | None = None
        # Producer: requests whose prompt is not saved yet, and lease keys of saved ones.
        self._to_save: dict[str, Request] = {}
        self._saved_keys: dict[str, str] = {}
        # Consumer: requests that had their one load attempt, its outcome, loads to dispatch.
        self._attempted: set[str] = set()
        self._outcomes: dict[str, LoadStatus] = {}
        self._loads: list[LoadRequest] = []

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    # -- consumer (and producer bookkeeping in update_state_after_alloc) --------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not _params(request).get("do_remote_prefill") or request.request_id in self._attempted:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = _params(request)
        req_id = request.request_id
        if params.get("do_remote_decode") and req_id not in self._saved_keys:
            self._to_save[req_id] = request
        if not params.get("do_remote_prefill") or req_id in self._attempted:
            return
        self._attempted.add(req_id)
        try:
            handoff = RayKVHandoff.from_dict(params.get(HANDOFF_PARAM))
        except ValueError as exc:
            self._loads.append(LoadRequest(req_id, None, refusal=str(exc)))
            return
        if num_external_tokens == 0:
            # The local prefix cache covered what the handoff offers: nothing to pull.
            self._outcomes[req_id] = "not_loaded"
            self._release([handoff.key])
            return
        refusal = self._refusal(request, handoff)
        if refusal is None:
            num_local = request.num_prompt_tokens - num_external_tokens
            try:
                plan = plan_load(handoff.num_tokens, num_local, self._block_size)
            except ValueError as exc:
                refusal = str(exc)
        if refusal is not None:
            self._loads.append(LoadRequest(req_id, handoff, refusal=refusal))
            return
        block_ids = blocks.get_block_ids()[0][plan.first_block : plan.end_block]
        self._loads.append(LoadRequest(req_id, handoff, tuple(block_ids), plan.first_block))

    def _refusal(self, request: Request, handoff: RayKVHandoff) -> str | None:
        if handoff.block_size != self._block_size:
            return f"block size mismatch: here {self._block_size}, producer {handoff.block_size}"
        if handoff.num_tokens != request.num_prompt_tokens:
            return (
                f"prompt has {request.num_prompt_tokens} tokens but the handoff holds KV "
                f"for {handoff.num_tokens}"
            )
        if handoff.prompt_digest != prompt_digest(request.prompt_token_ids or []):
            return "the handoff's KV was computed for a different prompt"
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            if req_id in self._attempted:
                self._outcomes[req_id] = "recomputed" if req_id in failed else "loaded"

    # -- producer ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RayKVConnectorMetadata:
        meta = RayKVConnectorMetadata(loads=self._loads)
        self._loads = []
        # Called before the scheduler advances num_computed_tokens for this step.
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, request in list(self._to_save.items()):
            num_new = scheduled.get(req_id, 0)
            if not num_new or request.num_computed_tokens + num_new < request.num_prompt_tokens:
                continue
            assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
            num_tokens = request.num_prompt_tokens
            all_blocks = self._kv_cache_manager.get_block_ids(req_id)[0]
            owner = _params(request).get(OWNER_PARAM) or lease_owner_id(self._engine_id, req_id)
            key = make_lease_key(str(owner))
            meta.saves.append(
                SaveRequest(
                    request_id=req_id,
                    key=key,
                    block_ids=tuple(all_blocks[: num_blocks_for(num_tokens, self._block_size)]),
                    num_tokens=num_tokens,
                    prompt_digest=prompt_digest(request.prompt_token_ids or []),
                )
            )
            del self._to_save[req_id]
            self._saved_keys[req_id] = key
        return meta

    # -- both ----------------------------------------------------------------------------

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are always freed at once; returns the request's output kv_transfer_params."""
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        params = _params(request)
        if params.get("do_remote_prefill"):
            return False, self._consumer_finished(request, params)
        self._to_save.pop(req_id, None)
        key = self._saved_keys.pop(req_id, None)
        if key is None:
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            self._release([key])  # aborted or failed: nobody will pull it
            return False, None
        return False, {HANDOFF_PARAM: self._describe(key)}

    def _consumer_finished(self, request: Request, params: dict[str, Any]) -> dict[str, Any]:
        req_id = request.request_id
        if req_id not in self._attempted:
            # Finished before any load (aborted while waiting, or rejected before admission).
            raw = params.get(HANDOFF_PARAM)
            if isinstance(raw, dict) and isinstance(raw.get("key"), str):
                self._release([raw["key"]])
            return {LOAD_STATUS_PARAM: "not_loaded"}
        self._attempted.discard(req_id)
        # No outcome yet: a load that failed under policy "fail" (vLLM drops these params).
        return {LOAD_STATUS_PARAM: self._outcomes.pop(req_id, "not_loaded")}

    def _describe(self, key: str) -> dict[str, Any] | None:
        try:
            handoff: dict[str, Any] | None = ray.get(
                self._registry.describe.remote(key), timeout=self._settings.fetch_timeout_s
            )
        except Exception:
            logger.exception("RayKVConnector: could not read lease %s from the registry", key)
            return None
        if handoff is None:
            logger.error("RayKVConnector: lease %s is missing right after its save", key)
        return handoff

    def _release(self, keys: list[str]) -> None:
        # Fire and forget: a lost release costs one lease period, never correctness.
        self._registry.release_many.remote(keys)
