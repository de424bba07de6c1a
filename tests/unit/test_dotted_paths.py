"""Every dotted path we name as a string resolves: what Serve, vLLM or Python import by name at
run time (a YAML's `import_path` and gRPC servicers, Serve's request routers and autoscaling
policies, vLLM's KV connector modules, `python -m` commands in the docs) is imported here, so a
move that forgets one fails in CI instead of in a replica."""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_layers import LAYERS, REPO, python_files

_PATH = re.compile(
    rf"(?:{'|'.join(LAYERS)})(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?::[A-Za-z_][A-Za-z0-9_.]*)?"
)


def resolve(path: str) -> object:
    """The object a dotted path names: `module`, `module:attr` or `module.attr`."""
    module, _, attr = path.partition(":")
    if not attr:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as error:
            if error.name != path:  # the module exists; something it imports does not
                raise
            module, _, attr = path.rpartition(".")
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _is_path(text: str) -> bool:
    return ("." in text or ":" in text) and _PATH.fullmatch(text) is not None


def strings_in_code() -> Iterator[tuple[str, str]]:
    for layer in LAYERS:
        for path in python_files(layer):
            for node in ast.walk(ast.parse(path.read_text())):
                is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
                if is_text and _is_path(node.value):
                    yield node.value, f"{path.relative_to(REPO)}:{node.lineno}"


def _yaml_strings(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _yaml_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _yaml_strings(item)
    elif isinstance(value, str):
        yield value
        if "\n" in value:  # an embedded document (KubeRay's serveConfigV2)
            with contextlib.suppress(yaml.YAMLError):
                yield from _yaml_strings(yaml.safe_load(value))


def strings_in_yaml() -> Iterator[tuple[str, str]]:
    for path in sorted(REPO.glob("*/**/*.yaml")):
        if path.relative_to(REPO).parts[0] in LAYERS:
            for document in yaml.safe_load_all(path.read_text()):
                for text in _yaml_strings(document):
                    if _is_path(text):
                        yield text, str(path.relative_to(REPO))


def modules_run_in_docs() -> Iterator[tuple[str, str]]:
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for module in re.findall(r"python -m ([A-Za-z_][\w.]*)", path.read_text()):
            if module.split(".")[0] in LAYERS:
                yield module, str(path.relative_to(REPO))


def test_the_scan_finds_the_paths_serve_and_vllm_load() -> None:
    found = {text for text, _ in [*strings_in_code(), *strings_in_yaml()]}
    assert {
        "deploy.app:build_app",
        "api.serve_grpc.add_PDServeServicer_to_server",
        "router.replica_router.PrefillRequestRouter",
        "router.replica_router.ColocatedRequestRouter",
        "kv_transfer.nixl_connector",
        "kv_transfer.ray_connector",
    } <= found


def test_every_named_path_resolves() -> None:
    """In a fresh interpreter: the KV connector modules import vLLM, kept out of this one."""
    named = sorted({*strings_in_code(), *strings_in_yaml(), *modules_run_in_docs()})
    script = (
        "import json, sys\n"
        "from tests.unit.test_dotted_paths import resolve\n"
        "failed = {}\n"
        "for path, where in json.load(sys.stdin):\n"
        "    try:\n"
        "        resolve(path)\n"
        "    except Exception as error:\n"
        "        failed[f'{where}: {path}'] = f'{type(error).__name__}: {error}'\n"
        "print(json.dumps(failed))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(named),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_serve_options_name_classes_that_resolve() -> None:
    from ray.serve.request_router import RequestRouter

    from deploy.app import deployment_options
    from deploy.config import AppConfig

    for config in (AppConfig(), AppConfig(topology="colocated")):
        for pool in config.pools:
            options = deployment_options(config, pool)
            router_class = resolve(options["request_router_config"].request_router_class)
            assert isinstance(router_class, type) and issubclass(router_class, RequestRouter)
            if "autoscaling_config" in options:
                policy = options["autoscaling_config"]["policy"]["policy_function"]
                assert callable(resolve(policy))


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_autoscaling_policies_resolve_to_their_pool(pool: str) -> None:
    from autoscaling.serve_policy import PoolAutoscaler, autoscaling_config_for

    policy = autoscaling_config_for(pool, "app", None, 1, 4)["policy"]["policy_function"]
    policy_class = resolve(policy)
    assert isinstance(policy_class, type) and issubclass(policy_class, PoolAutoscaler)
    assert policy_class.pool == pool


def test_grpc_servicers_resolve() -> None:
    from deploy.local import GRPC_SERVICERS

    for path in GRPC_SERVICERS:
        assert callable(resolve(path)), path


def test_kv_connectors_are_named_by_module_and_class() -> None:
    from kv_transfer.base import TransferSettings, backend_names, make_backend

    found = {text for text, _ in strings_in_code()}
    for name in backend_names():
        backend = make_backend(TransferSettings(backend=name))
        if not backend.connector:
            continue  # no vLLM connector (the sim engines' backend)
        assert backend.connector_module in found
        source = (REPO / Path(*backend.connector_module.split("."))).with_suffix(".py")
        assert f"class {backend.connector}(" in source.read_text()


def test_resolve_tells_a_missing_name_from_a_broken_module() -> None:
    assert resolve("deploy.app:build_app") is resolve("deploy.app.build_app")
    with pytest.raises(AttributeError):
        resolve("deploy.app:no_such_builder")
    with pytest.raises(ModuleNotFoundError):
        resolve("deploy.no_such_module.thing")
