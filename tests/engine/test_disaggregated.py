"""Prefill -> KV transfer -> decode on real CPU engines, against the monolithic engine and
transformers, for each KV backend and both models."""

from __future__ import annotations

import asyncio
import re

import pytest

from decode_workers.worker import DecodeWorker
from engine.local import LocalEngine
from engine.params import GenerationParams, StructuredOutput
from engine.reference import ReferenceModel
from engine.stats import KVLoadCounts
from prefill_workers.worker import PrefillWorker
from tests.builders import make_greedy, prompt_of_length
from tests.engine.conftest import TINY_PAIRS
from tests.pd import make_request, run_pd, wait_idle

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT_LENGTHS = [1, 10, 2 * BLOCK, 2 * BLOCK + 1, 1500]
Pair = tuple[PrefillWorker, DecodeWorker]


def _oracles(request: pytest.FixtureRequest, model_name: str) -> tuple[LocalEngine, ReferenceModel]:
    return (
        request.getfixturevalue(f"{model_name}_engine"),
        request.getfixturevalue(f"{model_name}_reference"),
    )


def assert_kv_loaded(decode: DecodeWorker, before: KVLoadCounts, num_requests: int) -> None:
    """Each request's prompt KV was loaded, not computed: decode computed at most each prompt's
    last token (vLLM's per-request cached-token count), and no load failed."""
    assert decode.stats.kv_loads.minus(before) == KVLoadCounts(num_loads=num_requests)


def assert_matches_oracles(
    got: list[int],
    prompt: tuple[int, ...],
    params: GenerationParams,
    mono: LocalEngine,
    reference: ReferenceModel,
) -> None:
    want = mono.generate([list(prompt)], params)[0].token_ids
    assert got == want, f"{len(prompt)}-token prompt: disaggregated {got} != monolithic {want}"
    oracle = reference.generate(list(prompt), params)
    assert got == oracle, f"{len(prompt)}-token prompt: {got} != transformers {oracle}"


async def test_greedy_matches_monolithic_and_transformers(
    pd_case: tuple[str, str, Pair], request: pytest.FixtureRequest
) -> None:
    _, model_name, (prefill, decode) = pd_case
    mono, reference = _oracles(request, model_name)
    params = make_greedy(max_tokens=12, ignore_eos=True)
    before = decode.stats.kv_loads
    for length in PROMPT_LENGTHS:
        prompt = prompt_of_length(mono.tokenizer, length)
        got = await run_pd(prefill, decode, make_request(prompt, params))
        assert_matches_oracles(got, prompt, params, mono, reference)
    assert_kv_loaded(decode, before, len(PROMPT_LENGTHS))
    assert await wait_idle(prefill, decode)


@TINY_PAIRS
async def test_sixteen_concurrent_requests(
    pd_case: tuple[str, str, Pair], request: pytest.FixtureRequest
) -> None:
    _, model_name, (prefill, decode) = pd_case
    mono, reference = _oracles(request, model_name)
    params = make_greedy(max_tokens=10, ignore_eos=True)
    prompts = [prompt_of_length(mono.tokenizer, 5 + 23 * i) for i in range(16)]
    before = decode.stats.kv_loads
    got = await asyncio.gather(*(run_pd(prefill, decode, make_request(p, params)) for p in prompts))
    for prompt, tokens in zip(prompts, got, strict=True):
        assert_matches_oracles(tokens, prompt, params, mono, reference)
    assert_kv_loaded(decode, before, len(prompts))
    assert await wait_idle(prefill, decode)


async def test_seeded_sampling_matches_monolithic(
    pd_case: tuple[str, str, Pair], request: pytest.FixtureRequest
) -> None:
    _, model_name, (prefill, decode) = pd_case
    mono, _ = _oracles(request, model_name)
    prompt = prompt_of_length(mono.tokenizer, 40)
    before = decode.stats.kv_loads
    for seed in (7, 12345):
        params = GenerationParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)
        got = await run_pd(prefill, decode, make_request(prompt, params))
        assert got == mono.generate([list(prompt)], params)[0].token_ids, seed
    assert_kv_loaded(decode, before, 2)
    greedy = mono.generate([list(prompt)], make_greedy(max_tokens=12, ignore_eos=True))
    assert got != greedy[0].token_ids  # the sampling really sampled


async def test_first_token_is_streamed_before_decode(pd_case: tuple[str, str, Pair]) -> None:
    from router.lifecycle import generate_disaggregated

    _, _, (prefill, decode) = pd_case
    events = []
    request = make_request(tuple(range(3, 60)), make_greedy(max_tokens=6, ignore_eos=True))
    before = decode.stats.kv_loads
    async for event in generate_disaggregated(prefill, decode, request):
        events.append(event)
    assert_kv_loaded(decode, before, 1)
    assert events[0].is_first and len(events[0].token_ids) == 1
    assert not any(e.is_first for e in events[1:])
    assert sum(len(e.token_ids) for e in events) == 6
    assert events[-1].finish_reason == "length"


@TINY_PAIRS
async def test_structured_output_holds_across_the_pools(
    pd_case: tuple[str, str, Pair], request: pytest.FixtureRequest
) -> None:
    """A constraint reaches both pools: prefill samples the first token under it, decode loads
    the prompt's KV, re-samples that token under it and goes on. The answer is the monolithic
    engine's under the same constraint, meets it, and is not the unconstrained answer."""
    _, model_name, (prefill, decode) = pd_case
    mono, _ = _oracles(request, model_name)
    prompt = prompt_of_length(mono.tokenizer, 40)
    choices = ("alpha", "beta", "gamma")
    cases = [
        (StructuredOutput("regex", "[0-9]{3}-[a-z]{2,6}"), r"[0-9]{3}-[a-z]{2,6}"),
        (StructuredOutput("choice", choices), "|".join(choices)),
    ]
    free = mono.generate([list(prompt)], make_greedy(max_tokens=16))[0].token_ids
    before = decode.stats.kv_loads
    for structured, pattern in cases:
        params = make_greedy(max_tokens=16, structured=structured)
        got = await run_pd(prefill, decode, make_request(prompt, params))
        assert got == mono.generate([list(prompt)], params)[0].token_ids, structured
        text = mono.tokenizer.decode(got, skip_special_tokens=True)
        assert re.fullmatch(pattern, text), (structured, text)
        assert got != free
    assert_kv_loaded(decode, before, len(cases))
    assert await wait_idle(prefill, decode)
