"""The KV transfer interface: one narrow backend class, backends registered by name.

Call order, per request:
  both sides
    transfer_config(engine_id, role)     once, at engine start: vLLM's KVTransferConfig
  producer side (prefill worker)
    producer_request_params(p, r)        per prefill: kv_transfer_params for max_tokens=1
    parse_producer_output(params)        per prefill: the engine's output params -> typed pull
    release_abandoned(p, r)              per prefill aborted by its caller: frees what the
                                         engine may have stored for it although its output
                                         (and the handoff in it) never reached the worker
  consumer side (decode worker)
    consumer_request_params(pull)        per decode: kv_transfer_params that make vLLM pull
    rejection_params(pull)               per handoff never decoded: lets the consumer engine's
                                         connector release the producer's lease now

An unknown backend name or a missing optional package is an error at start-up
(`make_backend` raises), never a silent fallback.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from engine.messages import KVPull

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig

FailurePolicy = Literal["recompute", "fail"]
Role = Literal["producer", "consumer", "both"]

# vLLM's name of each role. Every served engine is "both" (decode_workers/worker.py's
# EngineWorker): which half of a request it does is the router's choice, per call.
KV_ROLES: dict[Role, str] = {
    "producer": "kv_producer",
    "consumer": "kv_consumer",
    "both": "kv_both",
}


@dataclass(frozen=True)
class TransferSettings:
    backend: str = "ray"
    # What the decode engine does when KV cannot be loaded or fails verification.
    failure_policy: FailurePolicy = "recompute"
    lease_seconds: float = 60.0
    # A KV load still in flight past this fails, and the failure policy takes it (a producer
    # that stopped answering must not hold a request for ever).
    transfer_timeout_s: float = 30.0
    # Ray backend: the cluster the engines' child processes join, and the lease registry actor.
    ray_address: str | None = None
    ray_namespace: str = "pdserve"
    lease_registry: str = "pdserve-kv-leases"
    # NIXL backend: side-channel port of each engine's handshake listener; 0 picks a free one.
    nixl_port: int = 0
    # This engine's host address as its peers reach it: NIXL's side channel listens and is
    # announced there, and the ray backend's engine processes join Ray from it. Inside Ray it
    # is the node's IP; 127.0.0.1 serves one host only ("localhost" on another host is that
    # host's own loopback).
    node_ip: str = "127.0.0.1"
    # Where the engine's listeners bind (NIXL's side channel, vLLM's own sockets), and what it
    # announces to its peers; None: node_ip. Loopback keeps a one-host run off the network.
    listen_host: str | None = None

    @property
    def engine_host(self) -> str:
        return self.listen_host or self.node_ip

    def __post_init__(self) -> None:
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"failure_policy must be 'recompute' or 'fail', got {self.failure_policy!r}"
            )
        if self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")


class KVBackend(ABC):
    name: ClassVar[str]
    required_modules: ClassVar[tuple[str, ...]] = ()
    # The vLLM connector class, loaded by module path: a name registered in this process does
    # not reach vLLM's child processes.
    connector: ClassVar[str]
    connector_module: ClassVar[str]
    # True when releasing a handoff that the consumer engine may also have released (or may
    # still be reading) is harmless: then a decode that ends abnormally releases it again, which
    # closes the window where a cancel lands before the consumer engine has taken the request.
    release_is_idempotent: ClassVar[bool] = False

    def __init__(self, settings: TransferSettings) -> None:
        self.settings = settings

    def transfer_config(self, engine_id: str, role: Role) -> KVTransferConfig | None:
        from vllm.config import KVTransferConfig

        buffer_device = self.kv_buffer_device()
        return KVTransferConfig(
            kv_connector=self.connector,
            kv_connector_module_path=self.connector_module,
            kv_role=KV_ROLES[role],
            engine_id=engine_id,
            kv_load_failure_policy=self.settings.failure_policy,
            kv_connector_extra_config=self.connector_extra_config(),
            **({"kv_buffer_device": buffer_device} if buffer_device else {}),
        )

    @abstractmethod
    def connector_extra_config(self) -> dict[str, Any]: ...

    def kv_buffer_device(self) -> str | None:
        """Where the connector stages KV; None keeps vLLM's default."""
        return None

    def producer_request_params(self, producer_id: str, request_id: str) -> dict[str, Any]:
        return {"do_remote_decode": True}

    async def release_abandoned(self, producer_id: str, request_id: str) -> None:
        """After the producer aborted `request_id`: release any KV its engine stored for it.
        The default does nothing (the connector frees an aborted request's KV itself)."""
        return None

    async def num_stored_handoffs(self, producer_id: str) -> int:
        """Handoffs of `producer_id` whose KV lives outside its engine's blocks, not yet pulled
        or expired (what its process must outlive). The default: none (the KV stays in the
        engine's blocks until pulled, which the engine's idle check sees)."""
        return 0

    @abstractmethod
    def parse_producer_output(self, params: dict[str, Any]) -> KVPull: ...

    @abstractmethod
    def consumer_request_params(self, pull: KVPull) -> dict[str, Any]: ...

    def rejection_params(self, pull: KVPull) -> dict[str, Any]:
        return self.consumer_request_params(pull)

    def process_env(self) -> dict[str, str]:
        """Environment the engine processes need before they start: vLLM binds its own
        sockets (torch.distributed's store) to VLLM_HOST_IP, else to the address of the
        interface its default route leaves by."""
        return {"VLLM_HOST_IP": self.settings.engine_host}


_BACKENDS: dict[str, type[KVBackend]] = {}


def register_backend(cls: type[KVBackend]) -> type[KVBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    _load_builtin_backends()
    return sorted(_BACKENDS)


def make_backend(settings: TransferSettings) -> KVBackend:
    _load_builtin_backends()
    cls = _BACKENDS.get(settings.backend)
    if cls is None:
        raise ValueError(
            f"unknown KV transfer backend {settings.backend!r}; "
            f"known: {', '.join(sorted(_BACKENDS))}"
        )
    missing = [m for m in cls.required_modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"KV transfer backend {cls.name!r} needs the package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)}"
        )
    return cls(settings)


def _load_builtin_backends() -> None:
    for module in ("kv_transfer.nixl", "kv_transfer.ray_backend", "kv_transfer.sim_backend"):
        importlib.import_module(module)
