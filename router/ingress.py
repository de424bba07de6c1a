"""Router: the Serve ingress. gRPC (`pdserve.v1.PDServeService` through Serve's gRPC proxy, plus the
standard `grpc.health.v1.Health/Check`) and OpenAI HTTP (FastAPI), both over one RouterService.

gRPC errors: the status is set on Serve's grpc_context before raising, which Serve's proxy
turns into the call's status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAUTHENTICATED) with our
message.

With API keys configured (router/auth.py), every generation and model-listing call needs one;
the health checks stay open.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse
from ray import serve

from api.convert import (
    InvalidField,
    finish_reason_value,
    pools_message,
    request_to_body,
    timings_message,
    usage_message,
)
from api.gen.pdserve.v1 import pdserve_pb2
from api.serve_grpc import SERVICE, MalformedRequest
from control.breaker import BestEffort
from control.keys import LOCAL_PREFILL_METRIC
from control.store import ControlStore
from engine.models import resolve_model
from engine.prompts import load_tokenizer
from prefill_workers.replica import prefilled_locally

# Through the module, never `from router.pool_view import POOL_VIEW`: Serve pickles a
# deployment class's module by value (this one, for Router), which would give the Router a copy
# of the view made where the app was built, while the request routers fill the process's own
# (router/pool_view.py). Measured: the roles the Router applied never reached the routers.
from router import pool_view
from router.admission import AdmissionLimits
from router.auth import ApiKeys, Unauthenticated, bearer_token
from router.key_limits import ACQUIRE_TIMEOUT_S, LocalKeyLimiter, SharedKeyLimiter
from router.lifecycle import DEFAULT_MAX_MIGRATIONS, StreamInterrupted
from router.metrics import RouterMetrics
from router.openai_api import (
    error_response,
    http_app,
    models_body,
    openai_generate,
    unauthenticated_response,
)
from router.openai_fields import sampling_defaults
from router.pd_decision import PDDecider, StallBudget
from router.policy import LocalPrefill, PredictedPrefill
from router.pools import ColocatedEngines, DisaggregatedEngines
from router.roles import RolePoller
from router.service import (
    Caller,
    DeadlineExceeded,
    EngineStream,
    Overloaded,
    PreparedRequest,
    RouterService,
    StreamChunk,
    Usage,
)
from router.timings import RequestTimings
from router.token_inbox import TOKEN_CHANNEL_HOST_ENV, TokenInbox
from router.validation import InvalidRequest, RequestLimits

logger = logging.getLogger(__name__)


def _ready_replicas(app_name: str) -> dict[str, int]:
    """Running replicas per engine deployment of this app (the router itself answers)."""
    status = serve.status()
    app = status.applications.get(app_name)
    if app is None:
        return {}
    ready: dict[str, int] = {}
    for name, deployment in app.deployments.items():
        if name == "Router":
            continue
        ready[name] = int(deployment.replica_states.get("RUNNING", 0))
    return ready


# A request's latency samples reach Redis within this, or are dropped (a silent control plane
# must not pile up writes in the router).
SAMPLE_TIMEOUT_S = 1.0


async def _record_samples(store: ControlStore, values: dict[str, float | None]) -> None:
    await store.record_samples({m: v for m, v in values.items() if v is not None})


@dataclass(frozen=True)
class RouterSettings:
    """What `build_app` hands the Router deployment: frozen, picklable, no config tree."""

    app: str
    # A built-in name or a local folder: resolved in the router replica, for its tokenizer.
    model: str
    served_name: str | None
    max_model_len: int
    max_tokens_limit: int
    default_max_tokens: int
    admission: AdmissionLimits
    # One engine pool serving both phases, instead of a prefill and a decode pool.
    colocated: bool = False
    # The decode pool's backend may release a handoff twice (kv_transfer.base.KVBackend).
    release_is_idempotent: bool = False
    # Where latency samples go for `pdserve status`; None: nowhere.
    control_url: str | None = None
    # The keys callers must present; None: no authentication.
    api_keys: ApiKeys | None = None
    # Input limits (RequestLimits, and the HTTP body's bytes: 413 past it).
    max_prompt_chars: int = RequestLimits.max_prompt_chars
    max_stop_chars: int = RequestLimits.max_stop_chars
    max_messages: int = RequestLimits.max_messages
    max_structured_chars: int = RequestLimits.max_structured_chars
    max_body_bytes: int = 8 * 1024**2
    # Restarts of a request on other replicas after an engine failure (router/lifecycle.py).
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    request_timeout_s: float = 600.0
    local_prefill_max_tokens: int = 0
    key_limit_timeout_s: float = ACQUIRE_TIMEOUT_S
    # router.adaptive_prefill: the decode streams' TPOT target the decision keeps; None: off.
    adaptive_prefill_tpot_s: float | None = None
    adaptive_stall_budget: StallBudget = "stream"
    adaptive_itl_s: float | None = None  # with the "token" budget: the gap it bounds


def _prefill_placement(
    settings: RouterSettings, metrics: RouterMetrics
) -> LocalPrefill | PredictedPrefill | None:
    """Where new requests are prefilled (disaggregated topology): by predicted TTFT, by a
    prompt-length threshold, or (None) always on the prefill pool."""
    if settings.colocated:
        return None
    if settings.adaptive_prefill_tpot_s is not None:
        decider = PDDecider(
            settings.adaptive_prefill_tpot_s,
            stall_budget=settings.adaptive_stall_budget,
            itl_slo_s=settings.adaptive_itl_s,
        )
        return PredictedPrefill(decider, pool_view.POOL_VIEW, metrics.count_decision)
    if settings.local_prefill_max_tokens:
        return LocalPrefill(settings.local_prefill_max_tokens, metrics.count_decision)
    return None


def _channel_host() -> str:
    """Where this router's token channel listens: the node environment's
    `PDSERVE_TOKEN_CHANNEL_HOST` (loopback in local mode: `pdserve up` sets it), else the address
    Ray knows this node by, where replicas on other nodes reach it."""
    if os.environ.get(TOKEN_CHANNEL_HOST_ENV):
        return os.environ[TOKEN_CHANNEL_HOST_ENV]
    import ray

    try:
        return str(ray.util.get_node_ip_address())
    except Exception:  # not inside a Ray worker
        return "127.0.0.1"


def _router_replica_id() -> str:
    """This Serve replica's id ("router-<id>"), named in every request's timings."""
    try:
        return f"router-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # not inside a Serve replica
        return "router"


@serve.ingress(http_app)
class Router:
    def __init__(self, settings: RouterSettings, *handles: Any) -> None:
        model_path = resolve_model(settings.model)
        self.settings = settings
        self.model_id = settings.served_name or model_path.name
        tokenizer = load_tokenizer(str(model_path))
        self.metrics = RouterMetrics(settings.app)
        self.placement = _prefill_placement(settings, self.metrics)
        # The engines' streams come back over this router's token channel
        # (router/token_inbox.py), a frame per engine step for all of a replica's streams.
        self.inbox = TokenInbox(_channel_host())
        engines: EngineStream
        if settings.colocated:
            engines = ColocatedEngines(
                handles[0],
                settings.max_migrations,
                on_move=self.metrics.count_migration,
                inbox=self.inbox,
            )
        else:
            engines = DisaggregatedEngines(
                handles[0],
                handles[1],
                settings.release_is_idempotent,
                settings.max_migrations,
                on_move=self.metrics.count_migration,
                local_prefill=self.placement,
                pool_for=pool_view.POOL_VIEW.pool_for,
                inbox=self.inbox,
            )
        url = settings.control_url
        self.store = ControlStore.from_url(url, settings.app) if url else None
        self._roles_task: asyncio.Task[None] | None = None
        if self.store is not None and not settings.colocated:
            # Role flips come through the control plane (router/roles.py); Serve runs a sync
            # __init__ on the replica's event loop.
            poller = RolePoller(self.store, pool_view.POOL_VIEW, _router_replica_id())
            self._roles_task = asyncio.get_running_loop().create_task(poller.run())
        # Status percentiles are best effort: serving goes on while Redis is away.
        self._samples = BestEffort("recording latency samples in Redis", logger, SAMPLE_TIMEOUT_S)
        self.service = RouterService(
            tokenizer,
            RequestLimits(
                served_models=frozenset({self.model_id}),
                default_model=self.model_id,
                max_tokens_limit=settings.max_tokens_limit,
                default_max_tokens=settings.default_max_tokens,
                max_prompt_chars=settings.max_prompt_chars,
                max_stop_chars=settings.max_stop_chars,
                max_messages=settings.max_messages,
                max_structured_chars=settings.max_structured_chars,
            ),
            settings.admission,
            settings.max_model_len,
            engines,
            on_finish=self._on_finish,
            replica_id=_router_replica_id(),
            key_limiter=SharedKeyLimiter(self.store, timeout_s=settings.key_limit_timeout_s)
            if self.store
            else LocalKeyLimiter(),
            request_timeout_s=settings.request_timeout_s,
            openai_defaults=sampling_defaults(model_path),
        )
        self._background: set[asyncio.Task[Any]] = set()

    def _on_finish(self, outcome: str, timings: RequestTimings | None, usage: Usage) -> None:
        self.metrics.observe(outcome, timings)
        if timings is None:
            return
        num_tokens = usage.completion_tokens
        # None where the request had none: one token has no TPOT, a colocated one no transfer.
        tpot = timings.mean_tpot_s if num_tokens > 1 else None
        kv_transfer = timings.kv_transfer_s if timings.decode_start_s > 0 else None
        if isinstance(self.placement, PredictedPrefill):
            self.placement.decider.observe(
                usage.prompt_tokens, timings.prefill_s, kv_transfer, tpot, num_tokens
            )
        if self.store is None:
            return
        values = {
            "ttft": timings.ttft_s,
            "tpot": tpot,
            "queue_wait": timings.queue_wait_s,
            "prefill": timings.prefill_s,
            "kv_transfer": kv_transfer,
            # Where the prompt was computed (`pdserve status` shows the split).
            LOCAL_PREFILL_METRIC: None
            if self.settings.colocated
            else float(prefilled_locally(timings.prefill_replica, timings.decode_replica)),
        }
        store = self.store
        task = asyncio.ensure_future(self._samples.run(lambda: _record_samples(store, values)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _authenticate(self, authorization: str | None) -> Caller | None:
        """The caller `authorization` names (None when the app takes no keys); raises
        Unauthenticated (counted) when it holds no valid key."""
        keys = self.settings.api_keys
        if keys is None:
            return None
        try:
            name = keys.authenticate(bearer_token(authorization))
        except Unauthenticated:
            self.service.record_refusal("unauthenticated")
            raise
        return Caller(name, keys.limits_of(name))

    def _http_refusal(self, request: Request) -> JSONResponse | None:
        """OpenAI's 401 when the request holds no valid key; None when it may go on."""
        try:
            self._authenticate(request.headers.get("authorization"))
        except Unauthenticated as exc:
            return unauthenticated_response(exc)
        return None

    # --- OpenAI HTTP -----------------------------------------------------------------------

    async def _http_generate(self, request: Request, chat: bool) -> Any:
        try:
            caller = self._authenticate(request.headers.get("authorization"))
        except Unauthenticated as exc:
            return unauthenticated_response(exc)
        return await openai_generate(
            self.service, request, chat, self.settings.max_body_bytes, caller
        )

    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._http_generate(request, chat=False)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._http_generate(request, chat=True)

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        return self._http_refusal(request) or JSONResponse(
            models_body(self.model_id, self.settings.max_model_len)
        )

    @http_app.get("/health")
    async def http_health(self) -> Any:
        return JSONResponse({"status": "ok", "in_flight": self.service.num_in_flight})

    # --- gRPC: pdserve.v1.PDServeService -----------------------------------------------------

    def _authenticate_grpc(self, grpc_context: Any) -> Caller | None:
        metadata = dict(grpc_context.invocation_metadata() or ())
        try:
            return self._authenticate(metadata.get("authorization"))
        except Unauthenticated as exc:
            grpc_context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            grpc_context.set_details(f"{exc}: send it as 'authorization: Bearer <key>' metadata")
            raise

    async def _prepare_grpc(self, message: Any, grpc_context: Any) -> PreparedRequest:
        caller = self._authenticate_grpc(grpc_context)
        try:
            if isinstance(message, MalformedRequest):
                raise InvalidRequest("body", f"is not a valid {SERVICE} request: {message.error}")
            try:
                body = request_to_body(message)
            except InvalidField as exc:  # an enum the contract does not define
                raise InvalidRequest(exc.field, exc.message) from exc
            return await self.service.prepare_async(body, message.request_id, caller)
        except InvalidRequest as exc:
            if not exc.counted:
                self.service.record_refusal("invalid")
            grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            grpc_context.set_details(str(exc))
            raise

    async def _chunks(
        self, prepared: PreparedRequest, grpc_context: Any
    ) -> AsyncIterator[StreamChunk]:
        try:
            async for chunk in self.service.stream(prepared):
                yield chunk
        except Overloaded as exc:
            self.service.record_refusal("overloaded")
            grpc_context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            grpc_context.set_details(str(exc))
            raise
        except StreamInterrupted as exc:  # counted by the service, as an error
            grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
            grpc_context.set_details(str(exc))
            raise
        except DeadlineExceeded as exc:  # counted by the service, as a timeout
            grpc_context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            grpc_context.set_details(str(exc))
            raise

    async def Generate(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        prepared = await self._prepare_grpc(request, grpc_context)
        async for chunk in self._chunks(prepared, grpc_context):
            yield pdserve_pb2.GenerateResponse(
                request_id=chunk.request_id,
                text=chunk.text,
                token_ids=list(chunk.token_ids),
                finish_reason=finish_reason_value(chunk.finish_reason),
                usage=usage_message(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                if chunk.usage
                else None,
                timings=timings_message(chunk.timings),
            )

    async def Complete(self, request: Any, grpc_context: Any) -> Any:
        prepared = await self._prepare_grpc(request, grpc_context)
        texts: list[str] = []
        ids: list[int] = []
        last: StreamChunk | None = None
        async for chunk in self._chunks(prepared, grpc_context):
            texts.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        assert last is not None and last.usage is not None
        return pdserve_pb2.CompleteResponse(
            request_id=last.request_id,
            text="".join(texts),
            token_ids=ids,
            finish_reason=finish_reason_value(last.finish_reason),
            usage=usage_message(last.usage.prompt_tokens, last.usage.completion_tokens),
            timings=timings_message(last.timings),
            model=prepared.validated.model,
        )

    async def Health(self, request: Any) -> Any:
        ready = await asyncio.to_thread(_ready_replicas, self.settings.app)
        serving = bool(ready) and all(n > 0 for n in ready.values())
        # Deployments are named after their pools ("Prefill" for "prefill": deploy/app.py).
        pools = pools_message({name.lower(): n for name, n in ready.items()})
        return pdserve_pb2.HealthResponse(serving=serving, pools=pools)

    async def ListModels(self, request: Any, grpc_context: Any) -> Any:
        self._authenticate_grpc(grpc_context)
        return pdserve_pb2.ListModelsResponse(
            models=[
                pdserve_pb2.ModelInfo(id=self.model_id, max_model_len=self.settings.max_model_len)
            ]
        )

    # --- gRPC: grpc.health.v1.Health ---------------------------------------------------------

    async def Check(self, request: Any) -> Any:
        from grpc_health.v1 import health_pb2

        ready = await asyncio.to_thread(_ready_replicas, self.settings.app)
        serving = bool(ready) and all(n > 0 for n in ready.values())
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)


__all__ = ["Router", "error_response"]
