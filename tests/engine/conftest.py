"""The prefill/decode pairs the engine tests share.

`pd_case` is session-scoped and parametrized, so pytest runs every test of one
(backend, model) pair together, across modules, and keeps one pair alive at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_workers.worker import DecodeWorker
from kv_transfer.base import TransferSettings
from prefill_workers.worker import PrefillWorker
from tests.pd import start_pair

BACKENDS = ["nixl", "ray"]
MODELS = ["tiny", "default"]

Pair = tuple[PrefillWorker, DecodeWorker]

# The tiny model's pairs only: for tests of the KV machinery under load, where the default model
# costs CI a minute a test and shows nothing the tiny one does not (the greedy oracle tests keep
# the default model; tests/e2e/test_routing.py runs 8 default-model streams per backend).
TINY_PAIRS = pytest.mark.parametrize(
    "pd_case",
    [(b, "tiny") for b in BACKENDS],
    indirect=True,
    ids=[f"{b}-tiny" for b in BACKENDS],
)
# The `ray` backend's tiny pair only: for what only that backend has (its lease registry).
RAY_TINY = pytest.mark.parametrize("pd_case", [("ray", "tiny")], indirect=True, ids=["ray-tiny"])


@pytest.fixture(
    scope="session",
    params=[(b, m) for b in BACKENDS for m in MODELS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def pd_case(
    request: pytest.FixtureRequest, transfer_settings: dict[str, TransferSettings]
) -> Iterator[tuple[str, str, Pair]]:
    backend, model_name = request.param
    model: Path = request.getfixturevalue(f"{model_name}_model")
    pair = start_pair(model, transfer_settings[backend])
    yield backend, model_name, pair
    for worker in pair:
        worker.shutdown()
