"""The committed stubs under api/gen are what scripts/gen_proto.sh makes from api/pdserve.proto,
and the contract's shape (streaming, presence) is what the router and Ray Serve rely on."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from api.gen import pdserve_pb2

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "api" / "gen"


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
    fresh = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in GEN.iterdir() if p.is_file())
    assert fresh == committed
    for name in fresh:
        assert (tmp_path / name).read_text() == (GEN / name).read_text(), (
            f"api/gen/{name} is stale: run scripts/gen_proto.sh"
        )


def test_servicer_function_imports_by_dotted_path() -> None:
    # How Ray Serve's gRPCOptions.grpc_servicer_functions finds it.
    module_name, _, attr = "api.gen.pdserve_pb2_grpc.add_PDServeServicer_to_server".rpartition(".")
    assert callable(getattr(importlib.import_module(module_name), attr))


def test_messages_pickle_by_their_package_path() -> None:
    # Ray Serve's gRPC proxy pickles each request message to hand it to a replica.
    request = pdserve_pb2.GenerateRequest(prompt="Hi", max_tokens=0)
    assert type(request).__module__ == "api.gen.pdserve_pb2"
    assert pickle.loads(pickle.dumps(request)) == request


@pytest.mark.parametrize(
    ("method", "server_streaming"),
    [("Generate", True), ("Complete", False), ("Health", False), ("ListModels", False)],
)
def test_service_methods(method: str, server_streaming: bool) -> None:
    service = pdserve_pb2.DESCRIPTOR.services_by_name["PDServe"]
    assert service.full_name == "pdserve.v1.PDServe"
    descriptor = service.methods_by_name[method]
    assert descriptor.server_streaming is server_streaming
    assert not descriptor.client_streaming


def test_sampling_fields_have_presence() -> None:
    fields = pdserve_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    optional = {name for name, field in fields.items() if field.has_presence}
    expected = {"max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"}
    assert optional == expected
