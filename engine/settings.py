"""Engine settings shared by the prefill and decode pools, and their translation to vLLM.

One frozen record per engine. On the CPU build the values that matter are forced here
(eager mode, block size a multiple of 32, a bounded KV cache, pinned cores); on GPUs vLLM's own
defaults stand.

    EngineSpec ──resolve(), on the node that serves it──> EngineSettings ──vllm_kwargs()──> vLLM
    (model name, device "auto")                          (model folder, device detected)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.cores import claim_cores
from engine.models import resolve_model
from engine.platform import Device, detect_device

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

DType = Literal["float32", "bfloat16", "float16"]

CPU_BLOCK_MULTIPLE = 32
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class SimSpec:
    """A simulated engine (engine/sim/): no vLLM engine process; steps take the time the named
    profile gives, KV crosses the named link."""

    profile: str
    # A link of engine/sim/profiles/links.json; None: the profile's default link.
    link: str | None = None
    # Seconds a replica's start takes (models loading the weights).
    start_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.start_delay_s < 0:
            raise ValueError(f"start_delay_s must be >= 0, got {self.start_delay_s}")


@dataclass(frozen=True)
class EngineSettings:
    """How one vLLM engine runs. Built by `EngineSpec.resolve()`, or directly in tests."""

    model: Path
    device: Device = "cpu"
    # float32 by default: on CPU bf16 flips greedy answers of the default model at near-ties.
    dtype: DType = "float32"
    block_size: int | None = CPU_BLOCK_MULTIPLE
    kv_cache_memory_bytes: int | None = DEFAULT_CPU_KV_CACHE_BYTES
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    seed: int = 0
    # Cores this engine may use (CPU only). None leaves placement to the OS.
    cpu_cores: tuple[int, ...] | None = None
    gpu_memory_utilization: float = 0.9
    served_model_name: str | None = None
    # Set: a simulated engine (engine/sim/) instead of vLLM.
    sim: SimSpec | None = None
    # More of vLLM's EngineArgs (checked when the app config loads), over what is set above.
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def chunk_budget(self) -> int | None:
        """The chunked-prefill token budget the engine runs with: `engine_kwargs`' over the
        field, as the vLLM engine's arguments are built (None: the engine's default)."""
        return self.engine_kwargs.get("max_num_batched_tokens", self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.device == "cpu":
            if self.block_size is None or self.block_size % CPU_BLOCK_MULTIPLE:
                raise ValueError(
                    f"block_size must be a multiple of {CPU_BLOCK_MULTIPLE} on CPU, "
                    f"got {self.block_size}"
                )
            if self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes <= 0:
                raise ValueError("kv_cache_memory_bytes must be a positive byte count on CPU")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.cpu_cores is not None and not self.cpu_cores:
            raise ValueError("cpu_cores must name at least one core, or be None")

    @property
    def enforce_eager(self) -> bool:
        # CUDA graphs / torch.compile cost 15-50 s per engine start on CPU for no decode gain.
        return self.device == "cpu"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    def process_env(self) -> dict[str, str]:
        """Environment the engine's processes need; set before the engine starts."""
        env: dict[str, str] = {}
        if self.device == "cpu" and self.cpu_cores is not None:
            # Applied by vLLM's own CPU worker processes (multiprocess engines).
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in self.cpu_cores)
        return env

    def apply_process_env(self) -> None:
        os.environ.update(self.process_env())

    def vllm_kwargs(self, kv_transfer: KVTransferConfig | None = None) -> dict[str, Any]:
        """Keyword arguments for vLLM's EngineArgs / LLM: the one place our settings meet vLLM's."""
        kwargs: dict[str, Any] = {
            "model": str(self.model),
            "tokenizer": str(self.model),
            "served_model_name": self.model_name,
            "dtype": self.dtype,
            "seed": self.seed,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": self.enforce_eager,
        }
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        else:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        kwargs.update(self.engine_kwargs)
        if kv_transfer is not None:
            kwargs["kv_transfer_config"] = kv_transfer
        return kwargs

    def async_engine_args(self, kv_transfer: KVTransferConfig | None = None) -> AsyncEngineArgs:
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(**self.vllm_kwargs(kv_transfer))


@dataclass(frozen=True)
class EngineSpec:
    """An engine as a deployment receives it: the model by name (a built-in name or a local
    Hugging Face folder) and the device possibly "auto". `resolve()` runs inside the replica, so
    a built-in model is prepared, and the device detected, on the node that serves it."""

    model: str
    device: Device | Literal["auto"] = "auto"
    dtype: DType = "float32"
    block_size: int | None = CPU_BLOCK_MULTIPLE
    # Applies on CPU only; a GPU engine sizes its cache by `gpu_memory_utilization`.
    kv_cache_memory_bytes: int | None = DEFAULT_CPU_KV_CACHE_BYTES
    max_model_len: int = 4096
    max_num_seqs: int = 64
    seed: int = 0
    # Applies on CPU only.
    cpu_cores: tuple[int, ...] | None = None
    # Each replica computes on a slice of this many of `cpu_cores` that no other replica of
    # `core_group` on its machine holds (engine/cores.py); None: on all of them.
    cores_per_replica: int | None = None
    core_group: str = "pdserve"
    gpu_memory_utilization: float = 0.9
    served_model_name: str | None = None
    sim: SimSpec | None = None
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def resolve(self) -> EngineSettings:
        """Called once per replica, in it: with `cores_per_replica` it claims the replica's
        cores for the life of its process."""
        device = detect_device() if self.device == "auto" else self.device
        cores = self.cpu_cores if device == "cpu" else None
        if cores and self.cores_per_replica:
            cores = claim_cores(cores, self.cores_per_replica, self.core_group)
        return EngineSettings(
            model=resolve_model(self.model),
            device=device,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes if device == "cpu" else None,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            seed=self.seed,
            cpu_cores=cores,
            gpu_memory_utilization=self.gpu_memory_utilization,
            served_model_name=self.served_model_name,
            sim=self.sim,
            engine_kwargs=dict(self.engine_kwargs),
        )
