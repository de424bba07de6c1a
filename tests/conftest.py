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
def transfer_settings() -> dict[str, object]:
    """TransferSettings per backend name; the ray backend joins the session's Ray cluster."""
    from kv_transfer.base import TransferSettings

    return {"nixl": TransferSettings(backend="nixl")}
