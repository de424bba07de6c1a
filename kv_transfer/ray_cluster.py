"""Joining the cluster's Ray from whatever process a vLLM engine runs the connector in.

In-process engines (the offline `LLM`, a Serve replica) already run inside a Ray process. Served
engines (AsyncLLM) run the connector in vLLM's child processes, where Ray is not initialized and
RAY_ADDRESS is unset; a bare `ray.put` there would silently start a private cluster whose
objects nobody else can read. So a child joins the cluster by its GCS address, never starts one.

Token auth (Ray 2.60 default): `ray.init(address=...)` authenticates with RAY_AUTH_TOKEN, the
file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token. pdserve's runs hand every process
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH, and vLLM's children inherit the environment, so
they authenticate with no further setup.

A child joins from its node's address (`node_ip`): on a host whose default route does not lead
to the head, Ray's own guess of the node address finds no raylet there and the join fails.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from kv_transfer.base import TransferSettings

logger = logging.getLogger(__name__)

_joined_in_pid: int | None = None


def join_ray(address: str | None, namespace: str | None, node_ip: str | None = None) -> None:
    """Make Ray usable in this process: reuse a live connection or join `address` from the
    node at `node_ip` (None: Ray's guess)."""
    global _joined_in_pid
    if ray.is_initialized():
        if multiprocessing.parent_process() is not None and _joined_in_pid != os.getpid():
            # A forked child inherits the parent's Ray globals but none of its connections:
            # every call would hang. Only spawned children can join cleanly.
            raise RuntimeError(
                f"RayKVConnector: process {os.getpid()} inherited Ray from its parent by fork, "
                "which Ray does not support. Start vLLM's processes with spawn "
                "(VLLM_WORKER_MULTIPROC_METHOD=spawn; vLLM does so itself inside Ray actors)."
            )
        return
    if not address:
        raise RuntimeError(
            f"RayKVConnector: Ray is not initialized in process {os.getpid()} and "
            "kv_connector_extra_config has no 'ray_address'. Pass the cluster's GCS address "
            "(ray.get_runtime_context().gcs_address); the connector never starts a cluster."
        )
    try:
        ray.init(
            address=address,
            namespace=namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
            **({"_node_ip_address": node_ip} if node_ip else {}),
        )
    except ray.exceptions.AuthenticationError as exc:
        raise RuntimeError(
            f"RayKVConnector: the cluster at {address} refused this process's Ray token; make "
            "the cluster's token visible here (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            "~/.ray/auth_token)"
        ) from exc
    _joined_in_pid = os.getpid()
    _stop_error_listener()
    logger.info("process %d joined Ray at %s", os.getpid(), address)


def _stop_error_listener() -> None:
    """Stop the thread Ray starts in every driver to print the cluster's error messages.

    A process that joins by address is a driver, and the thread polls the GCS for messages in a
    loop that polls again at once when the poll returns nothing. From an engine's child process
    on a test host, every poll returned nothing at once: measured idle with the ray app up, each
    such process spent 17% of a core and the GCS 54%, slowing everything beside them. Nothing
    here reads those messages (log_to_driver is off); this stops the thread as Ray's own
    disconnect does (Ray 2.60, `ray._private.worker.disconnect`)."""
    worker = ray._private.worker.global_worker
    listener = getattr(worker, "listener_thread", None)
    if listener is None:
        return
    worker.threads_stopped.set()
    worker.gcs_error_subscriber.close()
    listener.join(timeout=5)
    worker.threads_stopped.clear()
    del worker.listener_thread


def start_local_transfer_cluster(settings: TransferSettings) -> TransferSettings:
    """A local Ray for this process (unless one is up) and the lease registry the `ray` backend
    needs; returns `settings` naming that Ray's address, for benches and single-machine runs."""
    from kv_transfer.ray_lease import start_lease_registry

    if not ray.is_initialized():
        ray.init(
            address="local",
            namespace=settings.ray_namespace,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    # Detached: Ray collects a named actor once its creator drops the handle; this one must
    # live as long as the (local) cluster does.
    start_lease_registry(settings.lease_registry, settings.ray_namespace, detached=True)
    return replace(settings, ray_address=ray.get_runtime_context().gcs_address)
