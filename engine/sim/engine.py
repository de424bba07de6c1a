"""SimAsyncLLM: the part of vLLM's AsyncLLM the workers use, with no engine process.

One asyncio task runs the engine loop in the replica's own event loop: schedule (SimScheduler),
wait the step's profiled duration, apply it, hand each request its new tokens. Outputs follow
the request's `SamplingParams.output_kind` as vLLM's do: DELTA (the tokens since the last
output; several when the reader fell behind), CUMULATIVE (all so far) or FINAL_ONLY.

KV transfer (kv_transfer_params, as the `sim` backend writes them):
  producer  {"do_remote_decode": True, "sim_producer": id}: one token, then the final output
            carries {"sim_kv": {producer, num_tokens, num_bytes}}; its blocks stay cached
  consumer  {"do_remote_prefill": True, "sim_kv": ...}: holds blocks for the prompt while the
            bytes cross the link (Link.transfer_seconds), then computes the last position only
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from engine.settings import EngineSettings
from engine.sim.blocks import BlockPool
from engine.sim.profile import Link, SimProfile, load_link, load_profile
from engine.sim.scheduler import SimRequest, SimScheduler, Step
from engine.sim.tokens import TokenSource
from engine.stats import EngineStatsRecorder

# The longest the idle loop sleeps before looking again (new requests wake it at once).
IDLE_POLL_S = 1.0


@dataclass(frozen=True)
class SimSamplingParams:
    """What a sim engine's `generate` takes: the fields of vLLM's SamplingParams it reads
    (engine/sampling.py makes them for any engine; the others do not change a sim step)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    seed: int | None = None
    output_kind: str = "CUMULATIVE"  # vLLM's RequestOutputKind, by name
    extra_args: dict[str, Any] | None = None

    @classmethod
    def from_fields(cls, **fields: Any) -> SimSamplingParams:
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})


@dataclass
class SimCompletion:
    token_ids: list[int]
    finish_reason: str | None
    index: int = 0
    text: str = ""


@dataclass
class SimMetrics:
    """vLLM's per-request stamps (monotonic), read by `engine_times`."""

    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0


@dataclass
class SimRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SimCompletion]
    finished: bool
    metrics: SimMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _Stream:
    request: SimRequest
    output_kind: str
    producer_id: str | None
    metrics: SimMetrics
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class SimAsyncLLM:
    # engine/sampling.py builds this engine's sampling params with it, not vLLM's.
    make_sampling_params = staticmethod(SimSamplingParams.from_fields)

    def __init__(
        self,
        settings: EngineSettings,
        profile: SimProfile,
        link: Link,
        tokens: TokenSource,
        recorder: EngineStatsRecorder | None = None,
    ) -> None:
        block_size = settings.block_size or 16
        num_blocks = profile.num_blocks(block_size, settings.kv_cache_memory_bytes)
        self.profile = profile
        self.link = link
        self.scheduler = SimScheduler(
            BlockPool(num_blocks, block_size),
            tokens,
            max_num_batched_tokens=settings.chunk_budget or profile.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
        )
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=num_blocks))
        self.errored = False
        self.num_steps = 0
        self.num_released = 0
        self._recorder = recorder
        self._streams: dict[str, _Stream] = {}
        self._transfers: list[tuple[float, int]] = []
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.Task[None] | None = None

    async def generate(
        self, prompt: dict[str, Any], sampling_params: SimSamplingParams, request_id: str
    ) -> AsyncIterator[SimRequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id} is already running")
        self._ensure_loop()
        stream = self._stream_for(prompt, sampling_params, request_id)
        self.scheduler.add(stream.request)
        self._streams[request_id] = stream
        assert self._wake is not None
        self._wake.set()
        num_done = 0
        try:
            while True:
                await stream.ready.wait()
                stream.ready.clear()
                new_ids, stream.new_token_ids = stream.new_token_ids, []
                num_done += len(new_ids)
                finished = stream.finish_reason is not None
                if stream.output_kind == "FINAL_ONLY" and not finished:
                    continue
                if stream.output_kind == "DELTA":
                    token_ids = new_ids
                else:
                    token_ids = stream.request.output_token_ids[:num_done]
                yield self._output(stream, token_ids, finished)
                if finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None and stream.finish_reason is None:
                self.scheduler.abort(request_id)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or self.scheduler.abort(request_id) is None:
            return
        stream.finish_reason = "abort"
        stream.ready.set()

    async def reset_prefix_cache(self) -> bool:
        return self.scheduler.blocks.reset_prefix_cache()

    async def notify_kv_transfer_request_rejected(self, request_id: str, params: Any) -> None:
        # The producer's blocks went back to its cache when its prefill finished; a release
        # has nothing left to free (counted for tests).
        self.num_released += 1

    async def check_health(self) -> None:
        if self.errored:
            raise RuntimeError("sim engine loop failed")

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            self._loop = None

    def _stream_for(
        self, prompt: dict[str, Any], sampling: SimSamplingParams, request_id: str
    ) -> _Stream:
        prompt_ids = tuple(int(t) for t in prompt["prompt_token_ids"])
        kv = (sampling.extra_args or {}).get("kv_transfer_params") or {}
        transfer_s = None
        if kv.get("do_remote_prefill"):
            num_bytes = int(kv["sim_kv"]["num_bytes"])
            transfer_s = self.link.transfer_seconds(num_bytes)
            self._transfers.append((transfer_s, num_bytes))
        seed = sampling.seed if (sampling.temperature or 0) > 0 else None
        request = SimRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=int(sampling.max_tokens or 16),
            token_seed=TokenSource.request_seed(prompt_ids, seed),
            kv_transfer_s=transfer_s,
        )
        kind = sampling.output_kind
        producer = kv.get("sim_producer") if kv.get("do_remote_decode") else None
        return _Stream(request, kind, producer, SimMetrics(queued_ts=time.monotonic()))

    def _output(self, stream: _Stream, token_ids: list[int], finished: bool) -> SimRequestOutput:
        request = stream.request
        kv_params = None
        if finished and stream.producer_id is not None:
            num_tokens = len(request.prompt_token_ids)
            kv_params = {
                "sim_kv": {
                    "producer": stream.producer_id,
                    "num_tokens": num_tokens,
                    "num_bytes": num_tokens * self.profile.kv_bytes_per_token,
                }
            }
        return SimRequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[SimCompletion(list(token_ids), stream.finish_reason)],
            finished=finished,
            metrics=stream.metrics,
            num_cached_tokens=request.num_cached_tokens,
            kv_transfer_params=kv_params,
        )

    def _ensure_loop(self) -> None:
        if self._loop is None or self._loop.done():
            self._wake = asyncio.Event()
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None
        step_end = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                step = self.scheduler.schedule(now) if self.scheduler.num_unfinished else None
                if step is None or not step.chunks:
                    await self._idle(now)
                    step_end = time.monotonic()
                    continue
                for chunk in step.chunks:
                    metrics = self._streams[chunk.request.request_id].metrics
                    metrics.scheduled_ts = metrics.scheduled_ts or now
                duration = self.profile.step_seconds(step.prefill_chunks, step.decode_contexts)
                # Steps run back to back on the profile's clock; Python's own time between
                # them is not added unless it exceeds the step.
                step_end = max(step_end, now - duration) + duration
                await asyncio.sleep(max(0.0, step_end - time.monotonic()))
                self._apply(step)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.errored = True
            raise

    async def _idle(self, now: float) -> None:
        assert self._wake is not None
        self._observe()
        ready_at = self.scheduler.next_kv_ready_at()
        timeout = IDLE_POLL_S if ready_at is None else max(0.0, ready_at - now)
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _apply(self, step: Step) -> None:
        self.num_steps += 1
        for sampled in self.scheduler.complete(step):
            stream = self._streams.get(sampled.request.request_id)
            if stream is None:
                continue
            stream.metrics.first_token_ts = stream.metrics.first_token_ts or time.monotonic()
            stream.new_token_ids.append(sampled.token_id)
            stream.finish_reason = sampled.finish_reason
            stream.ready.set()
        self._observe()

    def _observe(self) -> None:
        if self._recorder is None:
            return
        transfers, self._transfers = self._transfers, []
        self._recorder.observe(
            SimpleNamespace(
                num_running_reqs=len(self.scheduler.running),
                num_waiting_reqs=len(self.scheduler.waiting),
                kv_cache_usage=self.scheduler.blocks.usage,
                kv_connector_stats={
                    "transfer_duration": [s for s, _ in transfers],
                    "bytes_transferred": [b for _, b in transfers],
                },
            )
        )


def start_sim_engine(
    settings: EngineSettings,
    recorder: EngineStatsRecorder | None = None,
) -> tuple[SimAsyncLLM, float]:
    """A SimAsyncLLM for `settings` (whose `sim` names the profile), after the configured start
    delay (model loading, modelled), and the seconds it took."""
    spec = settings.sim
    if spec is None:
        raise ValueError("start_sim_engine needs settings with a sim spec")
    started = time.perf_counter()
    profile = load_profile(spec.profile)
    link = load_link(spec.link or profile.default_link)
    engine = SimAsyncLLM(settings, profile, link, TokenSource.for_model(settings.model), recorder)
    time.sleep(spec.start_delay_s)
    return engine, time.perf_counter() - started
