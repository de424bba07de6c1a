"""Worker side of RayKVConnector: copies whole KV blocks between the paged cache and Ray objects.

Each layer's cache is viewed as bytes, [num_blocks, *block bytes], whatever the attention backend's
layout (on CPU, LBHNC: [B, H, N, C] per layer), so a block is one contiguous row and the copy is a
row gather or scatter. Objects are numpy uint8 arrays: Ray maps them zero-copy on get, where
torch tensors would serialise several times slower.

    producer cache, layer l     [ b7 | b2 | b9 | ... ]   rows = the request's block ids
        gather rows  ->  object l = [num_blocks, block bytes]  + crc32 per row
    consumer cache, layer l     rows block_ids[i] <- object l row first_block + i (after crc check)

Saves run on the engine thread, in wait_for_save (after the forward wrote the KV). Loads run off
it: start_load_kv hands each request's load to a small thread pool and returns, and the request
waits in vLLM's WAITING_FOR_REMOTE_KVS until get_transfer_results reports it done, so a slow
fetch (a producer's host cut off, a registry that does not answer) holds up that request alone,
for at most `fetch_timeout_s` per call, and never the engine's other requests. The loads write
only the blocks vLLM allocated to their own request, which it keeps (even for an aborted
request) until the load is reported. Any failure of a load is reported, never raised, and never
leaves KV behind that vLLM would treat as computed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kv_transfer.blocks import BlockLayout, block_checksums, corrupt_blocks, kv_digest
from kv_transfer.ray_lease import StoredKV
from kv_transfer.ray_metadata import LoadRequest, SaveRequest
from kv_transfer.ray_params import RayKVHandoff, RayKVSettings
from kv_transfer.ray_stats import RayKVConnectorStats

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class KVLoadError(Exception):
    """A load that must not be used; the message names the cause."""


# Loads in flight at once per engine: each mostly waits on Ray (registry, object fetch).
LOAD_THREADS = 4


class RayKVWorker:
    def __init__(self, settings: RayKVSettings, engine_id: str, registry: Any) -> None:
        self._settings = settings
        self._engine_id = engine_id
        self._registry = registry
        self._layers: list[np.ndarray] = []
        self.layout: BlockLayout | None = None
        # Written by the load threads, read by the engine thread: under `_lock`.
        self._lock = threading.Lock()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._stats = RayKVConnectorStats()
        self._loads = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="ray-kv-load")

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], layout_fields: dict[str, Any], num_blocks: int
    ) -> None:
        import torch

        tensors = list(kv_caches.values())
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1 or tensors[0].shape[0] != num_blocks:
            raise ValueError(
                f"RayKVConnector needs one [num_blocks={num_blocks}, ...] cache per layer, "
                f"got shapes {sorted(shapes)}"
            )
        if any(t.device.type != "cpu" or t.stride(-1) != 1 for t in tensors):
            raise ValueError("RayKVConnector copies host KV caches with a contiguous last axis")
        # Shares memory with the cache: rows are blocks, columns the block's bytes.
        self._layers = [t.view(torch.uint8).numpy().reshape(num_blocks, -1) for t in tensors]
        self.layout = BlockLayout(
            num_layers=len(tensors),
            dtype=str(tensors[0].dtype).removeprefix("torch."),
            block_shape=tuple(tensors[0].shape[1:]),
            **layout_fields,
        )

    # -- producer ------------------------------------------------------------------------

    def save(self, saves: list[SaveRequest]) -> None:
        entries: list[tuple[str, StoredKV]] = []
        for request in saves:
            try:
                entries.append((request.key, self._store(request)))
            except Exception:
                logger.exception("RayKVConnector: storing KV of %s failed", request.request_id)
        if not entries:
            return
        # Synchronous: once the scheduler hands out a key, a consumer must be able to find it.
        try:
            ray.get(
                self._registry.register_many.remote(entries, self._settings.lease_seconds),
                timeout=self._settings.fetch_timeout_s,
            )
        except Exception:
            logger.exception("RayKVConnector: registering %d lease(s) failed", len(entries))
            # The call may still land (a slow or cut link to the registry's host). Nobody will
            # be handed these keys: release them. Ray runs one caller's calls to an actor in
            # order, so this release comes after a registration that lands late, and the
            # lease does not outlive the link cut by its whole period.
            self._registry.release_many.remote([key for key, _ in entries])

    def _store(self, request: SaveRequest) -> StoredKV:
        assert self.layout is not None, "register_kv_caches was not called"
        rows = np.asarray(request.block_ids, dtype=np.int64)
        refs: list[Any] = []
        checksums: list[list[int]] = []
        for layer in self._layers:
            blocks = layer[rows]  # fancy indexing: a contiguous copy
            checksums.append(block_checksums(blocks))
            refs.append(ray.put(blocks))
        handoff = RayKVHandoff(
            key=request.key,
            producer_id=self._engine_id,
            num_tokens=request.num_tokens,
            block_size=self.layout.block_size,
            num_blocks=len(request.block_ids),
            expires_at=0.0,  # the registry stamps it when the lease starts
            digest=kv_digest(checksums),
            prompt_digest=request.prompt_digest,
            layout=self.layout,
        )
        return StoredKV(refs=refs, checksums=checksums, handoff=handoff)

    # -- consumer ------------------------------------------------------------------------

    def load(self, loads: list[LoadRequest]) -> None:
        """Start one attempt per request, off the engine thread (see the module's doc); its
        outcome comes out of `take_results` once it is done."""
        for load in loads:
            if load.refusal is not None or load.handoff is None:
                if load.handoff is not None:  # refused: nobody will take it
                    self._registry.release_many.remote([load.handoff.key])
                self._fail(load.request_id, load.refusal or "no handoff")
            else:
                self._loads.submit(self._load_one, load)

    def _load_one(self, load: LoadRequest) -> None:
        """Take the lease, fetch, verify and copy in; then release the lease, whatever came of
        it."""
        handoff = load.handoff
        assert handoff is not None
        started = time.perf_counter()
        failure, num_bytes = None, 0
        try:
            try:
                stored = ray.get(
                    self._registry.take_many.remote([handoff.key]),
                    timeout=self._settings.fetch_timeout_s,
                )
            except Exception as exc:
                raise KVLoadError(f"lease registry unreachable: {exc!r}") from exc
            num_bytes = self._copy_in(load, stored.get(handoff.key))
        except Exception as exc:  # reported, never raised: the thread has no caller
            failure = str(exc) if isinstance(exc, KVLoadError) else repr(exc)
        # Released before the outcome is reported: a request done means its lease is let go.
        self._registry.release_many.remote([handoff.key])
        if failure is not None:
            self._fail(load.request_id, failure)
            return
        with self._lock:
            self._stats.record_transfer(time.perf_counter() - started, num_bytes)
            self._finished_recving.add(load.request_id)

    def _copy_in(self, load: LoadRequest, stored: StoredKV | None) -> int:
        """Verify and copy one request's blocks into the cache; returns the bytes copied."""
        handoff = load.handoff
        assert handoff is not None and self.layout is not None
        mismatch = self.layout.describe_mismatch(handoff.layout)
        if mismatch is not None:
            raise KVLoadError(f"KV layout mismatch ({mismatch})")
        if stored is None:
            raise KVLoadError(f"lease {handoff.key} is unknown, released or expired")
        if stored.handoff.digest != handoff.digest or kv_digest(stored.checksums) != handoff.digest:
            raise KVLoadError(f"lease {handoff.key} does not match the handoff's digest")
        end = load.first_block + len(load.block_ids)
        if len(stored.refs) != self.layout.num_layers or end > handoff.num_blocks:
            raise KVLoadError(f"lease {handoff.key} holds the wrong number of layers or blocks")
        rows = np.asarray(load.block_ids, dtype=np.int64)
        expected_shape = (handoff.num_blocks, self._layers[0].shape[1])
        timeout = self._settings.fetch_timeout_s
        # Start fetching every layer now (cross-node, in parallel); then verify and copy in order.
        ray.wait(stored.refs, num_returns=len(stored.refs), timeout=0, fetch_local=True)
        num_bytes = 0
        for index, (ref, layer) in enumerate(zip(stored.refs, self._layers, strict=True)):
            try:
                blocks = ray.get(ref, timeout=timeout)
            except Exception as exc:
                raise KVLoadError(f"layer {index} of {handoff.key} is lost: {exc!r}") from exc
            if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8:
                raise KVLoadError(f"layer {index} of {handoff.key} is not a uint8 array")
            if blocks.shape != expected_shape:
                raise KVLoadError(
                    f"layer {index} of {handoff.key} has shape {blocks.shape}, "
                    f"expected {expected_shape}"
                )
            part = blocks[load.first_block : end]
            bad = corrupt_blocks(part, stored.checksums[index][load.first_block : end])
            if bad:
                raise KVLoadError(
                    f"checksum mismatch in layer {index}, blocks "
                    f"{[load.first_block + i for i in bad]} of {handoff.key}"
                )
            layer[rows] = part
            num_bytes += part.nbytes
        return num_bytes

    def _fail(self, request_id: str, reason: str) -> None:
        logger.error("RayKVConnector: refusing remote KV for request %s: %s", request_id, reason)
        with self._lock:
            self._stats.record_failed_transfer()
            self._failed_recving.add(request_id)
            self._finished_recving.add(request_id)

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) since the last call; failed ones are in both."""
        with self._lock:
            finished, failed = self._finished_recving, self._failed_recving
            self._finished_recving, self._failed_recving = set(), set()
        return finished, failed

    def take_stats(self) -> RayKVConnectorStats | None:
        """The transfers since the last call (None: there were none)."""
        with self._lock:
            return None if self._stats.is_empty() else self._stats.clone_and_reset()
