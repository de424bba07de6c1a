"""Session-scoped models and engines: each is built or started once for the whole run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from engine.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def default_model() -> Path:
    from engine.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model: Path) -> Iterator[object]:
    from engine.local import LocalEngine
    from tests.builders import make_settings

    yield LocalEngine(make_settings(tiny_model))


@pytest.fixture(scope="session")
def default_engine(default_model: Path) -> Iterator[object]:
    from engine.local import LocalEngine
    from tests.builders import make_settings

    yield LocalEngine(make_settings(default_model))


@pytest.fixture(scope="session")
def tiny_reference(tiny_model: Path) -> object:
    from engine.reference import ReferenceModel

    return ReferenceModel(tiny_model)


@pytest.fixture(scope="session")
def default_reference(default_model: Path) -> object:
    from engine.reference import ReferenceModel

    return ReferenceModel(default_model)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """Two Ray nodes on this machine, each with its own raylet and object store (resources
    `node_a`, `node_b` place actors), joined by this process. Shared by every Ray test."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, namespace="pdserve-tests", logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def transfer_settings(ray_cluster: object) -> Iterator[dict[str, object]]:
    """TransferSettings per backend name; the ray backend joins the session's Ray cluster."""
    from kv_transfer.base import TransferSettings
    from kv_transfer.ray_lease import start_lease_registry

    ray_settings = TransferSettings(backend="ray", ray_address=ray_cluster.address)  # type: ignore[attr-defined]
    # Held for the session: Ray collects a named actor once no handle to it is left.
    registry = start_lease_registry(ray_settings.lease_registry, ray_settings.ray_namespace)
    yield {"nixl": TransferSettings(backend="nixl"), "ray": ray_settings}
    del registry
