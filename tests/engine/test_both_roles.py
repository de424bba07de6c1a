"""Engines of KV role "both" (EngineWorker): either engine of a pair prefills for the other and
decodes what the other prefilled, on the same loaded engines, in both directions in turn, and
serves whole requests itself; the greedy tokens equal the monolithic engine's and
transformers', and each decode loaded the prompt's KV rather than computing it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_workers.worker import EngineWorker
from engine.local import LocalEngine
from engine.reference import ReferenceModel
from engine.stats import KVLoadCounts
from kv_transfer.base import TransferSettings
from tests.builders import make_greedy, make_settings, prompt_of_length
from tests.engine.conftest import BACKENDS
from tests.pd import make_request, run_pd, wait_idle

pytestmark = pytest.mark.engine

Both = tuple[EngineWorker, EngineWorker]


@pytest.fixture(scope="module", params=BACKENDS)
def both_pair(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    transfer_settings: dict[str, TransferSettings],
) -> Iterator[Both]:
    transfer = transfer_settings[request.param]
    pair = (
        EngineWorker(make_settings(tiny_model, cpu_cores=(0,)), transfer),
        EngineWorker(make_settings(tiny_model, cpu_cores=(1,)), transfer),
    )
    for worker in pair:
        worker.start()
    yield pair
    for worker in pair:
        worker.shutdown()


async def test_either_engine_prefills_for_the_other(
    both_pair: Both, tiny_engine: LocalEngine, tiny_reference: ReferenceModel
) -> None:
    a, b = both_pair
    params = make_greedy(max_tokens=10, ignore_eos=True)
    loads_before = {w.worker_id: w.stats.kv_loads for w in both_pair}
    # A -> B, then B -> A, then A -> B again: a role flip is only which call each one gets.
    directions = [(a, b), (b, a), (a, b), (b, a)]
    for i, (producer, consumer) in enumerate(directions):
        prompt = prompt_of_length(tiny_engine.tokenizer, 40 + 37 * i)
        got = await run_pd(producer, consumer, make_request(prompt, params))
        want = tiny_engine.generate([list(prompt)], params)[0].token_ids
        assert got == want, f"{producer.worker_id} -> {consumer.worker_id}: {got} != {want}"
        assert got == tiny_reference.generate(list(prompt), params)
    for worker in both_pair:
        # Each decoded two of the four, loading every prompt's KV.
        assert worker.stats.kv_loads.minus(loads_before[worker.worker_id]) == KVLoadCounts(
            num_loads=2
        )
    assert await wait_idle(a, b)


async def test_an_engine_of_both_roles_serves_whole_requests(
    both_pair: Both, tiny_engine: LocalEngine
) -> None:
    a, _ = both_pair
    params = make_greedy(max_tokens=10, ignore_eos=True)
    prompt = prompt_of_length(tiny_engine.tokenizer, 90)
    tokens: list[int] = []
    async for event in a.generate(make_request(prompt, params)):
        tokens.extend(event.token_ids)
    assert tokens == tiny_engine.generate([list(prompt)], params)[0].token_ids
    assert await wait_idle(a)
