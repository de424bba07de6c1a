"""The committed stubs under api/gen are what scripts/gen_proto.sh makes from
api/proto/pdserve/v1/pdserve.proto, the wheel ships the proto, and the contract's shape (streaming,
presence, Complete's own request) is what the router and Ray Serve rely on."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from api.gen.pdserve.v1 import pdserve_pb2

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "api" / "gen"
PROTO = REPO / "api" / "proto" / "pdserve" / "v1" / "pdserve.proto"


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fresh = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(
        str(p.relative_to(GEN))
        for p in GEN.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == committed
    for name in fresh:
        assert (tmp_path / name).read_text() == (GEN / name).read_text(), (
            f"api/gen/{name} is stale: run scripts/gen_proto.sh"
        )


def test_the_proto_path_is_its_package() -> None:
    package = pdserve_pb2.DESCRIPTOR.package
    assert package == "pdserve.v1"
    assert pdserve_pb2.DESCRIPTOR.name == "pdserve/v1/pdserve.proto"
    assert PROTO.relative_to(REPO / "api" / "proto").parent.as_posix() == package.replace(".", "/")


def test_the_wheel_ships_the_proto() -> None:
    # setuptools' package data: globs relative to the package's folder.
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["api"]
    assert PROTO in [path for glob in globs for path in (REPO / "api").glob(glob)]


def test_servicer_function_imports_by_dotted_path() -> None:
    # How Ray Serve's gRPCOptions.grpc_servicer_functions finds it.
    path = "api.gen.pdserve.v1.pdserve_pb2_grpc.add_PDServeServiceServicer_to_server"
    module_name, _, attr = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module_name), attr))


def test_messages_pickle_by_their_package_path() -> None:
    # Ray Serve's gRPC proxy pickles each request message to hand it to a replica.
    request = pdserve_pb2.GenerateRequest(prompt="Hi", max_tokens=0)
    assert type(request).__module__ == "api.gen.pdserve.v1.pdserve_pb2"
    assert pickle.loads(pickle.dumps(request)) == request


@pytest.mark.parametrize(
    ("method", "server_streaming"),
    [("Generate", True), ("Complete", False), ("Health", False), ("ListModels", False)],
)
def test_service_methods(method: str, server_streaming: bool) -> None:
    service = pdserve_pb2.DESCRIPTOR.services_by_name["PDServeService"]
    assert service.full_name == "pdserve.v1.PDServeService"
    descriptor = service.methods_by_name[method]
    assert descriptor.server_streaming is server_streaming
    assert not descriptor.client_streaming
    # Each method has a request and a response of its own (buf's STANDARD lint asks it too).
    assert descriptor.input_type.name == f"{method}Request"
    assert descriptor.output_type.name == f"{method}Response"


def test_complete_takes_generates_fields() -> None:
    # The client sends a CompleteRequest as a GenerateRequest's bytes: same numbers, same types.
    def shape(message: Any) -> list[tuple[object, ...]]:
        return [
            (f.number, f.name, f.type, f.is_repeated, f.has_presence, f.message_type)
            for f in message.DESCRIPTOR.fields
        ]

    assert shape(pdserve_pb2.CompleteRequest) == shape(pdserve_pb2.GenerateRequest)


def test_sampling_fields_have_presence() -> None:
    fields = pdserve_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    optional = {name for name, field in fields.items() if field.has_presence}
    expected = {"max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"}
    assert optional == expected
