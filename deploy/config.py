"""The one typed config tree of a pdserve application, validated once at the edge.

The same tree is the `args:` of a Serve config's application (Serve validates it against
`build_app`'s annotation), what `pdserve up` loads from YAML, and what tests build directly.
Inside the app it is turned into frozen records (`EngineSettings`, `TransferSettings`,
`RequestLimits`, `AdmissionLimits`) and never passed around as a dict.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from autoscaling.config import DEFAULT_CONFIG, AutoscalingConfig
from control.records import PoolSLO
from engine.settings import CPU_BLOCK_MULTIPLE, DEFAULT_CPU_KV_CACHE_BYTES, SimSpec

Topology = Literal["disaggregated", "colocated", "auto"]
PoolName = Literal["prefill", "decode", "engine"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimConfig(_Strict):
    """A simulated engine instead of vLLM (engine/sim/): steps timed by a profile, no engine
    process, so many replicas fit on a small machine."""

    profile: str = Field("cpu-smollm2", description="a profile of engine/sim/profiles/")
    link: str | None = Field(
        None, description="KV link of engine/sim/profiles/links.json; None: the profile's own"
    )
    start_delay_s: float = Field(
        0.0, ge=0, description="seconds each replica takes to start (models loading weights)"
    )

    @model_validator(mode="after")
    def _known(self) -> SimConfig:
        from engine.sim.profile import load_link, load_profile

        profile = load_profile(self.profile)
        load_link(self.link or profile.default_link)
        return self

    def spec(self) -> SimSpec:
        return SimSpec(self.profile, self.link, self.start_delay_s)


class EngineConfig(_Strict):
    """How every vLLM engine of the app runs; both pools share it so their KV layouts match."""

    model: str = Field(
        "default",
        description="built-in model name (default, tiny), a local HF folder, or an HF repo id "
        "(org/name[@revision]; from the HF cache, downloaded only if missing and not offline)",
    )
    served_name: str | None = Field(
        None, description="model id clients send; the folder name if unset"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="engine build; auto detects a GPU"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="float32 keeps greedy answers exact on CPU"
    )
    max_model_len: int = Field(2048, ge=16, description="context length in tokens")
    block_size: int | None = Field(
        CPU_BLOCK_MULTIPLE,
        description="KV block size; a multiple of 32 on CPU, None for vLLM's GPU default",
    )
    kv_cache_memory_bytes: int | None = Field(
        DEFAULT_CPU_KV_CACHE_BYTES, gt=0, description="KV cache size per engine on CPU"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU share per engine")
    max_num_seqs: int = Field(64, ge=1, description="sequences one engine batches at most")
    seed: int = Field(0, ge=0, description="engine seed")
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="tokens per streamed message after a stream's first, as vLLM's "
        "--stream-interval: more tokens per message carry more tokens per second through the "
        "router and proxy, in steps of that many (engine/intervals.py)",
    )
    sim: SimConfig | None = Field(
        None, description="a simulated engine (no vLLM process); needs kv_transfer.backend: sim"
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="more of vLLM's EngineArgs for every engine (tensor_parallel_size, "
        "quantization, max_num_batched_tokens, ...); checked against EngineArgs when the "
        "config loads; a pool's own engine_kwargs add to or override these",
    )

    @model_validator(mode="after")
    def _cpu_blocks(self) -> EngineConfig:
        if self.device == "cpu" and (
            self.block_size is None or self.block_size % CPU_BLOCK_MULTIPLE
        ):
            raise ValueError(
                f"block_size must be a multiple of {CPU_BLOCK_MULTIPLE} on CPU, "
                f"got {self.block_size}"
            )
        return self


class PoolConfig(_Strict):
    """One pool of engine replicas (prefill, decode, or the colocated engine)."""

    num_replicas: int = Field(1, ge=1, description="replicas at start")
    min_replicas: int = Field(1, ge=0, description="autoscaling lower bound")
    max_replicas: int = Field(4, ge=1, description="autoscaling upper bound")
    cpu_cores: list[int] | None = Field(
        None, description="CPU cores this pool's engines compute on (CPU only); None: any"
    )
    cores_per_replica: int | None = Field(
        None,
        ge=1,
        description="each replica computes on its own slice of this many of cpu_cores, one no "
        "other replica of the pool on its machine holds (all of them once every slice is "
        "held); None: every replica on all of cpu_cores",
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray logical CPUs per replica")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per replica")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources per replica: places the pool on the nodes that "
        "offer them (e.g. {node_type_gpu: 1})",
    )
    max_ongoing_requests: int = Field(256, ge=1, description="Serve's per-replica request cap")
    health_check_period_s: float = Field(
        10.0,
        gt=0,
        description="seconds between Serve's health checks of a replica; Serve replaces one "
        "after 3 failed checks (an engine that died fails each at once)",
    )
    health_check_timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long one health check may take before it counts as failed (engines "
        "take a minute to start on CPU: a slow first check is not a failure)",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM EngineArgs for this pool's engines only, over engine.engine_kwargs",
    )

    @model_validator(mode="after")
    def _bounds(self) -> PoolConfig:
        if self.max_replicas < max(self.min_replicas, 1):
            raise ValueError("max_replicas must be >= max(min_replicas, 1)")
        if not self.min_replicas <= self.num_replicas <= self.max_replicas:
            raise ValueError("num_replicas must lie within [min_replicas, max_replicas]")
        if self.cpu_cores is not None and not self.cpu_cores:
            raise ValueError("cpu_cores must name at least one core, or be null")
        if self.cores_per_replica is not None and (
            self.cpu_cores is None or self.cores_per_replica > len(self.cpu_cores)
        ):
            raise ValueError("cores_per_replica must be at most the number of cpu_cores given")
        return self


class TransferConfig(_Strict):
    backend: Literal["nixl", "ray", "sim"] = Field(
        "nixl", description="KV transfer backend (sim: the simulated engines' only one)"
    )
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="what decode does when the KV cannot be loaded or verified"
    )
    lease_seconds: float = Field(60.0, gt=0, description="how long an unclaimed KV handoff lives")
    transfer_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a KV load still in flight past this fails and failure_policy takes it "
        "(nixl: the whole read; ray: each registry call and each layer's object)",
    )
    host: str | None = Field(
        None,
        description="address the engines listen on for KV handshakes (NIXL's side channel) and "
        "vLLM's own sockets; None: the node's address, which other hosts reach. `pdserve up` "
        "uses 127.0.0.1 (one host, nothing off loopback)",
    )


class RouterConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="router (ingress) replicas")
    max_in_flight: int = Field(256, ge=1, description="admitted requests per router replica")
    max_queued_prompt_tokens: int = Field(
        65_536, ge=1, description="admitted, not yet prefilled prompt tokens per router replica"
    )
    refusal_room: int = Field(
        256,
        ge=1,
        description="calls past max_in_flight a router replica takes only to refuse at once "
        "(429 / RESOURCE_EXHAUSTED) instead of Serve's proxy queuing them",
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="calls Serve's proxy holds for a router replica that has max_in_flight + "
        "refusal_room in hand; past it Serve refuses them (gRPC RESOURCE_EXHAUSTED, HTTP 503)",
    )
    proxy_gate: bool = Field(
        True,
        description="`pdserve up`: Serve's proxies refuse generation calls past max_in_flight x "
        "num_replicas in flight through them themselves, before the hop to a router replica "
        "(api/proxy_gate.py)",
    )
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a client may ask")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the client sends none")
    prefix_ttl_s: float = Field(300.0, gt=0, description="how long a prefix-index entry lives")
    stats_interval_s: float = Field(1.0, gt=0, description="replica status publish period")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources per router replica (places the routers)",
    )
    max_prompt_chars: int = Field(
        1_000_000, ge=1, description="prompt (or all messages') characters; 400 past it"
    )
    max_stop_chars: int = Field(256, ge=1, description="characters per stop string; 400 past it")
    max_messages: int = Field(1024, ge=1, description="chat messages per request; 400 past it")
    max_structured_chars: int = Field(
        65_536,
        ge=1,
        description="characters of a structured-output constraint (JSON schema, regex, "
        "grammar, choices); 400 past it",
    )
    max_body_bytes: int = Field(
        8 * 1024**2,
        ge=1024,
        description="HTTP request body bytes (413 past it) and gRPC message bytes (RESOURCE_"
        "EXHAUSTED; `pdserve up` sets it on Serve's proxy, a cluster sets "
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE on its nodes)",
    )
    max_migrations: int = Field(
        2,
        ge=0,
        description="times a request moves to other replicas when an engine, a replica or a KV "
        "transfer fails under it (the prompt plus the tokens delivered start again there); "
        "past them the call fails: gRPC UNAVAILABLE, HTTP 503 or an SSE error event",
    )
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        description="disaggregated topology: a new request whose prompt is at most this many "
        "tokens is prefilled on its decode replica itself, with no KV transfer (0: every "
        "request goes to the prefill pool); counted in pdserve_pd_decisions_total{path}",
    )
    adaptive_prefill: bool = Field(
        False,
        description="disaggregated topology: each new request is prefilled where its predicted "
        "TTFT is lower, on its decode replica (no KV transfer) or on the prefill pool, while "
        "the decode replica's streams stay within autoscaling.tpot_p95_s (router/"
        "pd_decision.py); counted in pdserve_pd_decisions_total{path}. Instead of "
        "local_prefill_max_tokens",
    )
    adaptive_stall_budget: Literal["stream", "token"] = Field(
        "stream",
        description="with adaptive_prefill: how long a local prefill may stall the decode "
        "replica's running streams: 'stream', the TPOT headroom over a stream's mean output "
        "(within the SLO); 'token', one token's headroom (long prompts go remote while "
        "streams run)",
    )
    adaptive_itl_s: float | None = Field(
        None,
        gt=0,
        description="with adaptive_stall_budget 'token': the inter-token gap a local prefill "
        "may stretch the decode replica's streams to (an ITL SLO); None: "
        "autoscaling.tpot_p95_s",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="longest a request may take, admission to last token (s); past it the "
        "call ends: gRPC DEADLINE_EXCEEDED, HTTP 504 or an SSE error event (a gRPC client's "
        "own deadline ends the call sooner: Serve's proxy cancels it)",
    )
    key_limit_timeout_s: float = Field(
        0.1,
        gt=0,
        description="longest a per-key limit check waits for Redis; past it the request is "
        "served without the key's limits (Redis is kept off the request path)",
    )
    api_keys_file: str | None = Field(
        None,
        description="file of hashed API keys (router/auth.py) callers must present; "
        "None: no authentication. Read when the app is built.",
    )


class AutoscalingSection(_Strict):
    """Per-pool autoscaling (prefill on TTFT, decode on TPOT) by our Serve policies. The SLOs
    here are the defaults; `pdserve slo set` overrides them in Redis on a running app."""

    enabled: bool = Field(True, description="scale the prefill and decode pools on their SLOs")
    ttft_p95_s: float = Field(5.0, gt=0, description="prefill pool's TTFT P95 target (s)")
    tpot_p95_s: float = Field(0.2, gt=0, description="decode pool's TPOT P95 target (s)")
    percentile: float = Field(95.0, gt=0, le=100, description="percentile the signals use")
    window_s: float = Field(60.0, gt=0, description="replicas' latency window (s)")
    tick_s: float = Field(10.0, gt=0, description="metrics push and decision period (s)")
    upscale_cooldown_s: float = Field(20.0, ge=0, description="least time between scale-ups")
    downscale_delay_s: float = Field(120.0, ge=0, description="calm this long before scaling down")
    downscale_cooldown_s: float = Field(30.0, ge=0, description="least time after any scale event")
    flip_first: bool = Field(
        True,
        description="grow a pool by flipping a replica of the other pool first (a recall of "
        "its own lent replica, or a borrow from a pool that would scale down), starting "
        "replicas only when no flip can (autoscaling/roles.py)",
    )
    split_follows_work: bool = Field(
        True,
        description="between scale events, flip engines between the pools' roles so the "
        "split follows the measured prefill share of the work (with flip_first)",
    )
    split_min_prefill_engines: Literal[0, 1] = Field(
        1,
        description="the fewest engines the split keeps serving prefill; 0 lends the last one "
        "to decoding while no prompt computed locally would stall a gap near the ITL SLO "
        "(router.adaptive_itl_s, else the TPOT SLO), and takes one back when local prompts "
        "stall past it (needs router.adaptive_prefill)",
    )

    def policy_config(self, itl_slo_s: float | None = None) -> AutoscalingConfig:
        """The policies' config; `itl_slo_s` (the router's ITL SLO) bounds the gap a local
        prompt may stall before the split takes a prefill engine back."""
        return replace(
            DEFAULT_CONFIG,
            percentile=self.percentile,
            window_s=self.window_s,
            tick_s=self.tick_s,
            upscale_cooldown_s=self.upscale_cooldown_s,
            downscale_delay_s=self.downscale_delay_s,
            downscale_cooldown_s=self.downscale_cooldown_s,
            flip_first=self.flip_first,
            split_follows_work=self.split_follows_work,
            split_min_prefill_engines=self.split_min_prefill_engines,
            split_stall_limit_s=itl_slo_s,
        )

    @property
    def slo(self) -> PoolSLO:
        return PoolSLO(ttft_p95_s=self.ttft_p95_s, tpot_p95_s=self.tpot_p95_s)


class PlanConfig(_Strict):
    """`topology: auto`: the planner (deploy/plan.py) picks the topology, the P:D split and
    adaptive prefill for this workload when the app is built, from a sim profile's step
    times. `pdserve plan` shows every candidate's predicted goodput."""

    workload: str = Field(
        "chat", description="a named workload (deploy/workloads/) or a workload YAML's path"
    )
    profile: str | None = Field(
        None,
        description="sim profile to predict with (engine/sim/profiles/); None: the app's own "
        "engine.sim profile, else cpu-smollm2 (this repository's CPU measurement)",
    )
    link: str | None = Field(None, description="KV link of the prediction; None: the profile's")
    wider_engines: dict[int, str] = Field(
        default_factory=dict,
        description="engines of n cores (GPUs) each, n -> the sim profile measured on one (e.g. "
        "{2: cpu-smollm2-2c-fit}): the planner also weighs engines // n of them against "
        "`engines` of `profile`'s",
    )
    engines: int | None = Field(
        None,
        ge=1,
        description="engines to split; None: prefill.num_replicas + decode.num_replicas",
    )
    attainment: float = Field(
        0.9, gt=0, le=1, description="share of requests that must meet the workload's SLOs"
    )
    ttft_s: float | None = Field(None, gt=0, description="TTFT SLO (s); None: the workload's")
    tpot_s: float | None = Field(None, gt=0, description="TPOT SLO (s); None: the workload's")
    itl_s: float | None = Field(
        None, gt=0, description="ITL (P99 gap) SLO (s); None: the workload's"
    )
    chunk_budgets: list[int] = Field(
        default_factory=list,
        description="chunked-prefill token budgets (vLLM's max_num_batched_tokens) to weigh each "
        "candidate at; the pick's is set in engine.engine_kwargs. Empty: the engine's own only. "
        "A small budget splits a long prompt into steps the running streams can wait through "
        "(Sarathi-Serve): under an ITL SLO it can matter more than the topology",
    )
    seed: int = Field(0, ge=0, description="seed of the modelled arrivals and lengths")
    min_gain: float = Field(
        1.1,
        ge=1,
        description="a split (disaggregated or adaptive) is picked over colocated only when "
        "its predicted goodput is this many times colocated's: the model leaves out the hops "
        "and the shared cores a split pays for",
    )

    @field_validator("chunk_budgets")
    @classmethod
    def _budgets_positive(cls, value: list[int]) -> list[int]:
        if bad := [n for n in value if n < 1]:
            raise ValueError(f"chunk budgets must be at least 1 token, got {bad}")
        return sorted(set(value))

    @field_validator("wider_engines")
    @classmethod
    def _widths_past_one(cls, value: dict[int, str]) -> dict[int, str]:
        if narrow := sorted(n for n in value if n < 2):
            raise ValueError(f"widths must be at least 2 (width 1 is `profile`), got {narrow}")
        return value


class ControlConfig(_Strict):
    redis_url: str | None = Field(
        None,
        description="control-plane Redis (redis://:password@host:port/db); None: the "
        "PDSERVE_REDIS_URL environment variable, or no control plane",
    )


class AppConfig(_Strict):
    """A whole pdserve application."""

    name: str = Field(
        "pdserve", pattern=r"^[A-Za-z0-9_.-]+$", description="app name; Redis key prefix"
    )
    topology: Topology = Field(
        "disaggregated",
        description="separate pools, one engine for both phases, or auto: what `plan` picks "
        "when the app is built",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    prefill: PoolConfig = Field(default_factory=PoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    colocated: PoolConfig = Field(
        default_factory=PoolConfig, description="engine pool when colocated"
    )
    kv_transfer: TransferConfig = Field(default_factory=TransferConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    autoscaling: AutoscalingSection = Field(default_factory=AutoscalingSection)
    control: ControlConfig = Field(default_factory=ControlConfig)
    plan: PlanConfig = Field(
        default_factory=PlanConfig, description="the planner, for topology auto"
    )

    @model_validator(mode="after")
    def _limits(self) -> AppConfig:
        if self.router.default_max_tokens > self.router.max_tokens_limit:
            raise ValueError("router.default_max_tokens must be <= router.max_tokens_limit")
        if self.router.adaptive_prefill and self.router.local_prefill_max_tokens:
            raise ValueError(
                "router.adaptive_prefill and router.local_prefill_max_tokens: choose one way "
                "to decide where prompts are prefilled"
            )
        if self.router.adaptive_itl_s is not None and self.router.adaptive_stall_budget != "token":
            raise ValueError(
                "router.adaptive_itl_s bounds one gap: it needs router.adaptive_stall_budget: token"
            )
        if (
            self.topology == "disaggregated"
            and self.autoscaling.split_min_prefill_engines == 0
            and not self.router.adaptive_prefill
        ):
            raise ValueError(
                "autoscaling.split_min_prefill_engines: 0 leaves no engine to prefill remotely: "
                "it needs router.adaptive_prefill, which then computes every prompt locally"
            )
        if self.engine.block_size is not None and self.engine.block_size < 1:
            raise ValueError("engine.block_size must be >= 1")
        if (self.engine.sim is not None) != (self.kv_transfer.backend == "sim"):
            raise ValueError("engine.sim and kv_transfer.backend: sim go together")
        check_engine_kwargs(self.engine.engine_kwargs, "engine")
        for pool, config in self.pools.items():
            section = "colocated" if pool == "engine" else pool
            check_engine_kwargs(config.engine_kwargs, section)
            tp = self.engine_kwargs(pool).get("tensor_parallel_size", 1)
            if config.num_gpus > 0 and tp != config.num_gpus:
                raise ValueError(
                    f"{section}.num_gpus: {config.num_gpus:g}, but its engines run "
                    f"tensor_parallel_size {tp}: a replica holds one GPU per tensor-parallel rank"
                )
            if self.kv_transfer.backend == "ray" and tp != 1:
                raise ValueError(
                    f"engine_kwargs.tensor_parallel_size: {tp} with kv_transfer.backend ray; "
                    "the ray backend moves one worker's KV (tensor_parallel_size 1): use nixl"
                )
        return self

    def engine_kwargs(self, pool: PoolName) -> dict[str, Any]:
        """vLLM EngineArgs for `pool`'s engines: the app's, then the pool's own over them."""
        return {**self.engine.engine_kwargs, **self.pools[pool].engine_kwargs}

    @property
    def pools(self) -> dict[PoolName, PoolConfig]:
        """The engine pools of the topology (`auto`, until deploy/plan.py resolves it: every
        pool it may become)."""
        if self.topology == "colocated":
            return {"engine": self.colocated}
        if self.topology == "auto":
            return {"prefill": self.prefill, "decode": self.decode, "engine": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}


# EngineArgs pdserve sets from its own `engine` fields (the KV layout both pools must share,
# the model, the cache size): EngineArgs name -> the field of `engine` to set instead.
MANAGED_ENGINE_ARGS = {
    "model": "model",
    "tokenizer": "model",
    "served_model_name": "served_name",
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "block_size": "block_size",
    "max_num_seqs": "max_num_seqs",
    "seed": "seed",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "gpu_memory_utilization": "gpu_memory_utilization",
    # pdserve groups tokens in its replicas, for vLLM and sim engines alike.
    "stream_interval": "stream_interval",
}


def check_engine_kwargs(kwargs: dict[str, Any], section: str) -> None:
    """Each name in `section`'s engine_kwargs must be one of vLLM's EngineArgs and not one
    pdserve sets itself; raises ValueError naming the first that is not (vLLM is imported
    only when there are any)."""
    if not kwargs:
        return
    where = f"{section}.engine_kwargs"
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in kwargs:
        if name in MANAGED_ENGINE_ARGS:
            raise ValueError(f"{where}.{name}: set engine.{MANAGED_ENGINE_ARGS[name]} instead")
        if name == "kv_transfer_config":
            raise ValueError(f"{where}.{name}: set the kv_transfer section instead")
        if name not in known:
            raise ValueError(f"{where}.{name}: not an argument of vLLM's EngineArgs")


def with_sim_engine(
    data: dict[str, Any], profile: str, link: str | None = None, start_delay_s: float = 0.0
) -> dict[str, Any]:
    """A config tree (`AppConfig.model_dump()`) turned to sim engines: the profile, the `sim`
    backend, and pools that claim no Ray CPU or cores (a sim replica computes nothing)."""
    data = {**data, "engine": dict(data["engine"]), "kv_transfer": dict(data["kv_transfer"])}
    data["engine"]["sim"] = {"profile": profile, "link": link, "start_delay_s": start_delay_s}
    data["kv_transfer"]["backend"] = "sim"
    for pool in ("prefill", "decode", "colocated"):
        data[pool] = {**data[pool], "num_cpus": 0, "cpu_cores": None, "cores_per_replica": None}
    return data


def load_app_config(path: Path, **overrides: Any) -> AppConfig:
    """The AppConfig of a pdserve YAML: either a bare config tree, or a Serve config whose first
    application has `args` (what `serve deploy` takes)."""
    import yaml

    raw = yaml.safe_load(path.read_text()) or {}
    if "applications" in raw:
        raw = raw["applications"][0].get("args") or {}
    return AppConfig.model_validate({**raw, **overrides})
