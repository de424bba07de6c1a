"""Session-scoped models and engines: each is built or started once for the whole run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.hosts import HostCluster, Hosts

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
def hosts() -> Iterator[Hosts]:
    """Three hosts on this machine (a: this namespace; b, c: network namespaces), removed at
    the end even when tests fail. Where they cannot be made, every test using them fails and
    says why: the multi-host tests are never skipped."""
    from tests.hosts import HostsUnavailable, make_hosts

    try:
        made = make_hosts()
    except HostsUnavailable as exc:
        pytest.fail(f"cannot build the test hosts: {exc}")
    yield made
    made.remove()


@pytest.fixture(scope="session")
def ray_cluster(hosts: Hosts) -> Iterator[HostCluster]:
    """A Ray cluster with one node per host (resources `host_a`, `host_b`, `host_c` place
    actors and replicas), joined by this process from host a. Shared by every Ray test, with
    its own token: nothing is read from or written to ~/.ray."""
    import ray

    from deploy.local import use_ray_token
    from tests.hosts import start_host_cluster, wait_nodes

    cluster = start_host_cluster(hosts)
    try:
        use_ray_token(cluster.token_path)
        ray.init(
            address=cluster.address,
            _node_ip_address=hosts.ip("a"),
            namespace="pdserve-tests",
            logging_level="WARNING",
        )
        wait_nodes(len(hosts.names))
        yield cluster
        ray.shutdown()
    finally:
        cluster.shutdown()


# The engine pairs' KV transfer deadline: short, so the test of a producer that stops answering
# waits less (a load on this machine takes milliseconds).
TEST_TRANSFER_TIMEOUT_S = 8.0


@pytest.fixture(scope="session")
def transfer_settings(ray_cluster: HostCluster) -> Iterator[dict[str, object]]:
    """TransferSettings per backend name for engines in this process (host a); the ray backend
    joins the session's Ray cluster. An engine on another host replaces `node_ip` by its own."""
    from kv_transfer.base import TransferSettings
    from kv_transfer.ray_lease import start_lease_registry

    here = ray_cluster.head_ip
    ray_settings = TransferSettings(
        backend="ray",
        ray_address=ray_cluster.address,
        node_ip=here,
        transfer_timeout_s=TEST_TRANSFER_TIMEOUT_S,
    )
    # Held for the session: Ray collects a named actor once no handle to it is left.
    registry = start_lease_registry(ray_settings.lease_registry, ray_settings.ray_namespace)
    nixl_settings = TransferSettings(
        backend="nixl", node_ip=here, transfer_timeout_s=TEST_TRANSFER_TIMEOUT_S
    )
    yield {"nixl": nixl_settings, "ray": ray_settings}
    del registry


# Fixtures that start a vLLM engine (directly or through a Serve app): a test using one must
# carry the `engine` marker, so `pytest -m "not engine"` stays the fast loop.
ENGINE_FIXTURES = frozenset({"tiny_engine", "default_engine", "pd_case", "serve_apps"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("engine") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that start an engine need @pytest.mark.engine: " + ", ".join(unmarked)
        )
    # The README's quick start first, under a fresh HOME, before any other test has left state
    # (a Ray token, a model cache) on this machine that could hide a missing step. Then the
    # autoscaling app, before any module deploys the e2e package's shared apps: it scales a
    # pool up, and its new replica needs the cores and Ray CPUs those apps would hold (a
    # module sorting before it, test_api_keys.py, once left the second replica pending).
    first = ("tests/readme/", "tests/e2e/test_autoscaling_app.py")
    items.sort(
        key=lambda item: next(
            (i for i, prefix in enumerate(first) if item.nodeid.startswith(prefix)), len(first)
        )
    )
