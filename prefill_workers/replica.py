"""What every engine replica of the Serve app shares (prefill, decode and colocated): the
settings record `build_app` hands it, and the Serve shell around its engine (id, health, idle,
the load it reports to its request router and publishes to the control plane).

Here, in the lowest package that holds a deployment; decode_workers/ imports it downward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from engine.async_engine import ServedEngine
from engine.messages import EngineRefused, ReplicaFailure, ReplicaLoad, TokenEvent
from engine.settings import EngineSpec
from engine.token_outbox import TokenOutbox
from engine.token_wire import TokenRoute
from kv_transfer.base import TransferSettings

logger = logging.getLogger(__name__)


class LoadSink(Protocol):
    """Where a replica publishes its load (`pdserve status`): the control plane's publisher,
    built by `build_app`, since the replica packages sit below control/. It bounds, logs and
    swallows its own failures: status is informational, and routing goes on without it."""

    async def publish(self, load: ReplicaLoad) -> bool: ...


@dataclass(frozen=True)
class ReplicaSettings:
    """What `build_app` hands one pool's deployment, as Ray Serve LLM hands each of its
    deployments an LLMConfig: frozen, and picklable (Serve passes it as the init argument)."""

    app: str
    engine: EngineSpec
    # The KV transfer; None for the colocated engine, which moves no KV.
    transfer: TransferSettings | None = None
    # Where the replica publishes its load; None: no control plane (or a pool nobody scales).
    status: LoadSink | None = None
    # The autoscaling window the replica reports on (`record_autoscaling_stats`).
    window_s: float = 60.0
    percentile: float = 95.0
    # Tokens per streamed message after a stream's first (engine/intervals.py).
    stream_interval: int = 1

    def require_transfer(self) -> TransferSettings:
        if self.transfer is None:
            raise ValueError(f"{self.app}: a KV producer or consumer needs transfer settings")
        return self.transfer


def serve_replica_id(default: str) -> str:
    """The Serve replica's unique id (what the request router sees), or `default` outside Serve."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not inside a Serve replica (engine tests)
        return default


def serve_metric_labels(pool: str) -> dict[str, str] | None:
    """The labels of this replica's vLLM metrics beside vLLM's own (`ReplicaId` among them):
    its app and pool; None outside a Serve replica (engine tests export nothing)."""
    try:
        from ray import serve

        return {"app": serve.get_replica_context().app_name, "pool": pool}
    except Exception:  # not inside a Serve replica
        return None


def pool_worker_id(pool: str, unique_id: str) -> str:
    """The id a replica's engine goes by in handoffs, token events and loads: its pool and its
    Serve replica's unique id ("decode-x1y2z3")."""
    return f"{pool}-{unique_id}"


def unique_id_of(worker_id: str) -> str:
    """The Serve replica's unique id in a `pool_worker_id` (pool names hold no '-')."""
    return worker_id.split("-", 1)[-1]


def pool_of(worker_id: str) -> str:
    """The pool in a `pool_worker_id` ("decode" for "decode-x1y2z3"): the replica's own pool,
    whatever pool's calls a role flip has it take."""
    return worker_id.split("-", 1)[0]


def prefilled_locally(prefill_replica: str, decode_replica: str) -> bool:
    """Whether a disaggregated request's prompt was computed by the replica that decoded it
    (its worker ids, from the request's timings): the local path. Not read from the pool in
    the ids: after a role flip a decode-pool replica prefills for others."""
    return bool(decode_replica) and prefill_replica == decode_replica


class PendingPrefill:
    """Prompt tokens accepted and not yet prefilled by a replica whose streams prefill too (the
    colocated pool; an engine of the KV pools counts its own in a PrefillWindow): a request's
    tokens count from its call until its first event, or until it ends without one."""

    def __init__(self) -> None:
        self.num_tokens = 0

    async def counted(
        self, num_tokens: int, events: AsyncIterator[TokenEvent]
    ) -> AsyncIterator[TokenEvent]:
        self.num_tokens += num_tokens
        pending = True
        try:
            async for event in events:
                if pending and event.is_first:
                    self.num_tokens -= num_tokens
                    pending = False
                yield event
        finally:
            if pending:
                self.num_tokens -= num_tokens


class ReplicaShell:
    """Mixin for a deployment class holding one started engine in `self._engine_owner`."""

    pool: ClassVar[str]
    _engine_owner: ServedEngine
    _status: LoadSink | None = None
    # How long a stopping replica waits for its engine's KV to be freed (0: it does not wait).
    drain_timeout_s: float = 0.0
    _stopping: bool = False
    _outbox: TokenOutbox | None = None

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt tokens accepted and not yet prefilled (0 for a pool that never prefills)."""
        return 0

    def start_engine(self, owner: ServedEngine, status: LoadSink | None) -> None:
        """Name `owner` after this Serve replica (what the request router sees), start its
        engine, and keep where to publish its load: what every engine deployment does first."""
        owner.worker_id = pool_worker_id(self.pool, serve_replica_id(owner.worker_id))
        owner.stats.export_labels = serve_metric_labels(self.pool)
        owner.start()
        self._engine_owner = owner
        self._status = status

    @contextlib.contextmanager
    def failures_named(self) -> Iterator[None]:
        """Around a call's work: a ValueError (the request's own fault) leaves as it is, any
        other failure as a ReplicaFailure naming this replica (router/lifecycle.py moves the
        request and avoids the replica)."""
        try:
            yield
        except (ValueError, ReplicaFailure):
            raise
        except Exception as exc:
            # vLLM's errors of the request's own (4xx), known by name: a sim replica never
            # imports vLLM.
            if any(cls.__name__ == "VLLMClientError" for cls in type(exc).__mro__):
                raise EngineRefused(str(exc)) from exc
            worker_id = self._engine_owner.worker_id
            raise ReplicaFailure(worker_id, f"{type(exc).__name__}: {exc}") from exc

    async def delivered(
        self, events: AsyncIterator[TokenEvent], route: TokenRoute | None
    ) -> AsyncIterator[TokenEvent]:
        """A stream call's events: its own items, or with `route` (the calling router's token
        channel, engine/token_wire.py) sent there, the call yielding none and ending with them."""
        if route is None:
            async for event in events:
                yield event
            return
        if self._outbox is None:
            self._outbox = TokenOutbox()
        await self._outbox.send_all(events, route)

    def on_stats_tick(self) -> None:
        """Hook run on each routing-stats period (decode exports its KV transfer metrics)."""

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every `request_routing_stats_period_s`; read by the request router."""
        self.on_stats_tick()
        self._engine_owner.stats.refresh_exported_gauges()
        load = self._engine_owner.load(self.pool, self.num_pending_prefill_tokens)
        if self._status is not None:
            await self._status.publish(load)
        return load.to_stats()

    async def check_health(self) -> None:
        """Serve's health probe: a dead EngineCore marks the replica unhealthy and replaces it."""
        await self._engine_owner.engine.check_health()

    async def is_idle(self) -> bool:
        """True when the engine holds no KV block (strict: a prefix-cache reset succeeds)."""
        return bool(await self._engine_owner.is_idle())

    async def idle_report(self, avoid: Sequence[str] = ()) -> tuple[str, bool]:
        """This replica's worker id and `is_idle`: a probe of one replica of a pool. The pool's
        request router skips the replicas `avoid` names (as for a moved request), so a caller
        reaches each replica by avoiding the others; the id says which one answered."""
        return self._engine_owner.worker_id, await self.is_idle()

    async def abort(self, request_id: str) -> None:
        await self._engine_owner.abort(request_id)

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Serve's graceful shutdown, once this replica's calls have ended (Serve stopped routing
        to it and waited for them): the engine stops. A replica whose engine may still hold KV
        for others (a prefill replica's handoffs, until the decode side pulls them or their
        lease ends) first waits up to `drain_timeout_s` for it to be freed: it returns that wait,
        which Serve awaits. Synchronous otherwise, so that a collected object (the garbage
        collector calls `__del__` too, and awaits nothing) leaves no coroutine behind."""
        owner = getattr(self, "_engine_owner", None)
        if owner is None or self._stopping:
            return None
        self._stopping = True
        if self.drain_timeout_s <= 0:
            owner.shutdown()
            return None
        return self._drain_then_stop(owner)

    async def _drain_then_stop(self, owner: ServedEngine) -> None:
        try:
            if not await owner.wait_drained(self.drain_timeout_s):
                logger.warning(
                    "%s: KV still held after %.0f s of draining; stopping anyway",
                    owner.worker_id,
                    self.drain_timeout_s,
                )
        except Exception as exc:  # a dead engine has nothing left to drain
            logger.warning("%s: draining failed (%s); stopping", owner.worker_id, exc)
        finally:
            owner.shutdown()
