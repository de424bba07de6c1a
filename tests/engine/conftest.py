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
