"""RayKVConnector on real vLLM engines (tiny model): KV moves through Ray's object store.

Fast path: the session's Ray (tests/conftest.py) joined by the pytest process and in-process
offline engines (tests/engine/kv_harness.py). The last test runs real AsyncLLM engines, whose
connectors live in vLLM's child processes and join that Ray by address.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from deploy.local import ray_auth_env
from kv_transfer.base import TransferSettings, make_backend
from kv_transfer.ray_params import consumer_params
from tests.builders import make_settings
from tests.engine.kv_harness import (
    PRODUCE,
    InprocEngine,
    KVUsageRecorder,
    greedy,
    last_output,
    make_prompt,
    prefill,
    tokens,
    wait_for_no_leases,
)
from tests.hosts import HostCluster

pytestmark = pytest.mark.engine

NAMESPACE = "pdserve-test-ray-kv"
REGISTRY = "pdserve-test-kv-leases"


@pytest.fixture(scope="module")
def ray_address(ray_cluster: Any) -> str:
    """GCS address of the session's Ray (tests/conftest.py), which this process has joined."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


@pytest.fixture(scope="module")
def registry(ray_address: str) -> Any:
    from kv_transfer.ray_lease import start_lease_registry

    return start_lease_registry(REGISTRY, NAMESPACE)


def connector_config(
    role: str, engine_id: str, *, kv_load_failure_policy: str = "recompute", **kwargs: Any
) -> Any:
    """The engine's KVTransferConfig, built by the `ray` backend as the served workers do."""
    settings = TransferSettings(
        backend="ray",
        failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
        ray_namespace=NAMESPACE,
        lease_registry=REGISTRY,
        **kwargs,
    )
    side = "producer" if role == "kv_producer" else "consumer"
    return make_backend(settings).transfer_config(engine_id, side)


@pytest.fixture(scope="module")
def producer(tiny_model: Path, registry: Any) -> InprocEngine:
    return InprocEngine(make_settings(tiny_model), connector_config("kv_producer", "prefill-0"))


@pytest.fixture(scope="module")
def consumer(tiny_model: Path, registry: Any) -> InprocEngine:
    return InprocEngine(make_settings(tiny_model), connector_config("kv_consumer", "decode-0"))


@pytest.fixture(scope="module")
def chunked_producer(tiny_model: Path, registry: Any) -> InprocEngine:
    settings = make_settings(tiny_model, max_num_batched_tokens=128)
    return InprocEngine(settings, connector_config("kv_producer", "prefill-chunked"))


@pytest.fixture(scope="module")
def strict_consumer(tiny_model: Path, registry: Any) -> InprocEngine:
    """Policy `fail`: a KV load failure ends the request in error instead of recomputing."""
    config = connector_config("kv_consumer", "decode-strict", kv_load_failure_policy="fail")
    return InprocEngine(make_settings(tiny_model), config)


@pytest.fixture(scope="module")
def wide_consumer(tiny_model: Path, registry: Any) -> InprocEngine:
    """Blocks of 64 tokens: a producer with blocks of 32 does not fit it."""
    config = connector_config("kv_consumer", "decode-64")
    return InprocEngine(make_settings(tiny_model, block_size=64), config)


@pytest.fixture(scope="module")
def monolithic(tiny_model: Path) -> InprocEngine:
    return InprocEngine(make_settings(tiny_model))


@pytest.mark.parametrize("num_tokens", [1, 20, 64, 97, 1500])
def test_greedy_decode_from_pulled_kv_matches_monolithic(
    num_tokens: int, producer: InprocEngine, consumer: InprocEngine, monolithic: InprocEngine
) -> None:
    prompt = make_prompt(num_tokens, seed=num_tokens)
    (produced,) = producer.generate([prompt], greedy(1, PRODUCE))
    handoff = produced.kv_transfer_params["ray_kv"]
    assert handoff["num_tokens"] == num_tokens
    assert handoff["num_blocks"] == -(-num_tokens // 32) and handoff["block_size"] == 32
    assert handoff["producer_id"] == "prefill-0" and len(handoff["digest"]) == 64
    assert handoff["expires_at"] > time.time()
    assert handoff["layout"]["num_layers"] == 4 and handoff["layout"]["dtype"] == "float32"

    params = consumer_params(produced.kv_transfer_params)
    (decoded,) = consumer.generate([prompt], greedy(16, params))
    (expected,) = monolithic.generate([prompt], greedy(16))
    assert decoded.kv_transfer_params == {"ray_kv_load": "loaded"}
    assert tokens([decoded]) == tokens([expected])
    assert decoded.outputs[0].token_ids[0] == produced.outputs[0].token_ids[0]
    # At most the last prompt token was recomputed: the rest came from the pulled KV.
    assert decoded.num_cached_tokens >= num_tokens - 1


def test_sixteen_concurrent_requests(
    producer: InprocEngine, consumer: InprocEngine, monolithic: InprocEngine
) -> None:
    prompts = [make_prompt(1 + 37 * i, seed=100 + i) for i in range(16)]
    handoffs = prefill(producer, prompts)
    decoded = consumer.generate(prompts, [greedy(12, consumer_params(h)) for h in handoffs])
    assert tokens(decoded) == tokens(monolithic.generate(prompts, greedy(12)))
    assert all(out.kv_transfer_params == {"ray_kv_load": "loaded"} for out in decoded)


def test_chunked_prefill_is_saved_once_complete(
    chunked_producer: InprocEngine, consumer: InprocEngine, monolithic: InprocEngine
) -> None:
    """A prompt prefilled in chunks of 128 tokens is stored after its last chunk, whole."""
    prompt = make_prompt(700, seed=150)
    (params,) = prefill(chunked_producer, [prompt])
    assert params["ray_kv"]["num_tokens"] == 700 and params["ray_kv"]["num_blocks"] == 22
    (decoded,) = consumer.generate([prompt], greedy(12, consumer_params(params)))
    assert decoded.kv_transfer_params == {"ray_kv_load": "loaded"}
    assert tokens([decoded]) == tokens(monolithic.generate([prompt], greedy(12)))
    assert chunked_producer.num_used_blocks() == 0


def test_seeded_sampling_matches_monolithic(
    producer: InprocEngine, consumer: InprocEngine, monolithic: InprocEngine
) -> None:
    from vllm import SamplingParams

    def sampled(seed: int, max_tokens: int, kv: dict[str, Any] | None = None) -> Any:
        extra = {"kv_transfer_params": kv} if kv is not None else None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.9,
            top_p=0.95,
            seed=seed,
            ignore_eos=True,
            extra_args=extra,
        )

    prompts = [make_prompt(n, seed=200 + n) for n in (5, 40, 130, 700)]
    seeds = [11, 22, 33, 44]
    produced = producer.generate(prompts, [sampled(s, 1, PRODUCE) for s in seeds])
    handoffs = [consumer_params(p.kv_transfer_params) for p in produced]
    decoded = consumer.generate(
        prompts, [sampled(s, 16, h) for s, h in zip(seeds, handoffs, strict=True)]
    )
    expected = monolithic.generate(prompts, [sampled(s, 16) for s in seeds])
    assert tokens(decoded) == tokens(expected)
    assert [t[0] for t in tokens(decoded)] == [t[0] for t in tokens(produced)]


def tamper(registry: Any, handoff: dict[str, Any], what: str) -> None:
    """Re-register the stored KV of `handoff` with one layer's object altered in transit."""
    import numpy as np
    import ray

    from kv_transfer.blocks import block_checksums

    key = handoff["key"]
    stored = ray.get(registry.take_many.remote([key]))[key]
    altered = np.array(ray.get(stored.refs[1]))  # a writable copy of layer 1
    altered[0, 100] ^= 0x01  # one bit of block 0
    stored.refs[1] = ray.put(altered)
    if what == "payload and checksums":  # a forger who also rewrites the checksum table
        stored.checksums[1] = block_checksums(altered)
    ray.get(registry.register_many.remote([(key, stored)], 60.0))


@pytest.mark.parametrize("what", ["payload", "payload and checksums"])
def test_altered_kv_is_detected_and_recomputed(
    what: str,
    producer: InprocEngine,
    consumer: InprocEngine,
    monolithic: InprocEngine,
    registry: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompt = make_prompt(150, seed=300 + len(what))
    (params,) = prefill(producer, [prompt])
    tamper(registry, params["ray_kv"], what)
    with caplog.at_level(logging.ERROR, logger="kv_transfer"):
        (decoded,) = consumer.generate([prompt], greedy(16, consumer_params(params)))
    assert decoded.kv_transfer_params == {"ray_kv_load": "recomputed"}
    assert tokens([decoded]) == tokens(monolithic.generate([prompt], greedy(16)))
    cause = "checksum mismatch in layer 1, blocks [0]" if what == "payload" else "digest"
    assert cause in caplog.text


def test_altered_kv_fails_the_request_under_policy_fail(
    producer: InprocEngine, strict_consumer: InprocEngine, registry: Any
) -> None:
    prompt = make_prompt(90, seed=400)
    (params,) = prefill(producer, [prompt])
    tamper(registry, params["ray_kv"], "payload")
    (decoded,) = strict_consumer.generate([prompt], greedy(16, consumer_params(params)))
    assert decoded.outputs[0].finish_reason == "error"
    assert list(decoded.outputs[0].token_ids) == []
    assert strict_consumer.num_used_blocks() == 0


def test_layout_mismatch_is_refused(
    producer: InprocEngine,
    strict_consumer: InprocEngine,
    wide_consumer: InprocEngine,
    monolithic: InprocEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompt = make_prompt(70, seed=500)
    (params,) = prefill(producer, [prompt])
    params["ray_kv"]["layout"]["dtype"] = "bfloat16"
    with caplog.at_level(logging.ERROR, logger="kv_transfer"):
        (decoded,) = strict_consumer.generate([prompt], greedy(8, consumer_params(params)))
    assert decoded.outputs[0].finish_reason == "error"
    assert "KV layout mismatch (dtype: here 'float32', producer 'bfloat16')" in caplog.text

    # A consumer engine with another block size refuses a real handoff; policy recompute.
    (params,) = prefill(producer, [prompt])
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kv_transfer"):
        (decoded,) = wide_consumer.generate([prompt], greedy(8, consumer_params(params)))
    assert "block size mismatch: here 64, producer 32" in caplog.text
    assert decoded.kv_transfer_params == {"ray_kv_load": "recomputed"}
    assert tokens([decoded]) == tokens(monolithic.generate([prompt], greedy(8)))
    assert wide_consumer.num_used_blocks() == 0


def test_released_lease_is_recomputed(
    producer: InprocEngine,
    consumer: InprocEngine,
    monolithic: InprocEngine,
    registry: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import ray

    prompt = make_prompt(45, seed=600)
    (params,) = prefill(producer, [prompt])
    assert ray.get(registry.release_many.remote([params["ray_kv"]["key"]])) == 1
    with caplog.at_level(logging.ERROR, logger="kv_transfer"):
        (decoded,) = consumer.generate([prompt], greedy(8, consumer_params(params)))
    assert "is unknown, released or expired" in caplog.text
    assert decoded.kv_transfer_params == {"ray_kv_load": "recomputed"}
    assert tokens([decoded]) == tokens(monolithic.generate([prompt], greedy(8)))


def test_leases_expire_in_the_registry(registry: Any) -> None:
    import ray

    from kv_transfer.ray_lease import StoredKV
    from kv_transfer.ray_params import RayKVHandoff
    from tests.unit.test_kv_blocks import make_handoff

    handoff: RayKVHandoff = make_handoff(key="expiring")
    ray.get(registry.register_many.remote([("expiring", StoredKV([], [], handoff))], 0.2))
    described = ray.get(registry.describe.remote("expiring"))
    assert described is not None and described["expires_at"] <= time.time() + 0.2
    time.sleep(0.3)
    assert ray.get(registry.describe.remote("expiring")) is None
    assert ray.get(registry.num_live.remote()) == 0


def test_no_leaks_after_many_requests_with_aborts(
    producer: InprocEngine, consumer: InprocEngine, registry: Any
) -> None:
    prompts = {f"r{i}": make_prompt(10 + 53 * i, seed=700 + i) for i in range(28)}
    produced = producer.run(
        {rid: (p, greedy(1, PRODUCE)) for rid, p in prompts.items()},
        abort_at_step={"r0": 0, "r1": 0, "r2": 0, "r3": 1, "r4": 1},
    )
    assert {"r0", "r1", "r2"}.isdisjoint(produced) and len(produced) >= 23
    handoffs = {rid: out.kv_transfer_params for rid, out in produced.items()}
    decoded = consumer.run(
        {rid: (prompts[rid], greedy(6, consumer_params(h))) for rid, h in handoffs.items()},
        # Aborted before any load (lease released by request_finished), or after the load.
        abort_at_step={"r5": 0, "r6": 0, "r7": 0, "r8": 0, "r9": 1, "r10": 2, "r11": 3},
    )
    assert {"r5", "r6", "r7", "r8"}.isdisjoint(decoded) and len(decoded) >= len(handoffs) - 7
    assert all(o.kv_transfer_params == {"ray_kv_load": "loaded"} for o in decoded.values())
    assert wait_for_no_leases(registry) == 0
    assert producer.num_used_blocks() == 0
    assert consumer.num_used_blocks() == 0


def test_async_llm_engines_in_child_processes(
    ray_address: str,
    registry: Any,
    tiny_model: Path,
    monolithic: InprocEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Served engines: the connector runs in vLLM's child processes and joins Ray by address."""
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    settings = make_settings(tiny_model)
    usage = {"prefill-mp": KVUsageRecorder(), "decode-mp": KVUsageRecorder()}

    import ray

    node_ip = ray.util.get_node_ip_address()  # the children join the node this process is on

    def start(role: str, engine_id: str) -> Any:
        config = connector_config(role, engine_id, ray_address=ray_address, node_ip=node_ip)
        args = settings.async_engine_args(config)
        return AsyncLLM.from_engine_args(args, stat_loggers=[usage[engine_id].factory])

    with ThreadPoolExecutor(2) as pool:  # the two engines start side by side
        starting = [
            pool.submit(start, "kv_producer", "prefill-mp"),
            pool.submit(start, "kv_consumer", "decode-mp"),
        ]
        prefill_engine, decode_engine = (f.result() for f in starting)
    prompts = [make_prompt(n, seed=900 + n) for n in (33, 250, 600)]

    async def scenario() -> list[Any]:
        produced = await asyncio.gather(
            *(
                last_output(
                    prefill_engine.generate(
                        TokensPrompt(prompt_token_ids=p), greedy(1, PRODUCE), request_id=f"p{i}"
                    )
                )
                for i, p in enumerate(prompts)
            )
        )
        # The decode side rejects the last handoff before admission: its lease must go.
        rejected = consumer_params(produced[-1].kv_transfer_params)
        await decode_engine.notify_kv_transfer_request_rejected("rejected", rejected)
        return list(
            await asyncio.gather(
                *(
                    last_output(
                        decode_engine.generate(
                            TokensPrompt(prompt_token_ids=p),
                            greedy(12, consumer_params(out.kv_transfer_params)),
                            request_id=f"d{i}",
                        )
                    )
                    for i, (p, out) in enumerate(zip(prompts[:-1], produced[:-1], strict=True))
                )
            )
        )

    try:
        decoded = asyncio.run(scenario())
    finally:
        prefill_engine.shutdown()
        decode_engine.shutdown()
    assert tokens(decoded) == tokens(monolithic.generate(prompts[:-1], greedy(12)))
    assert all(out.kv_transfer_params == {"ray_kv_load": "loaded"} for out in decoded)
    assert wait_for_no_leases(registry) == 0
    assert usage["prefill-mp"].usage == 0.0 and usage["decode-mp"].usage == 0.0


def test_a_process_that_joins_runs_no_error_polling_thread(ray_cluster: HostCluster) -> None:
    """A process that joins by address (an engine's child) is a Ray driver, and Ray starts a
    thread in it that polls the GCS for error messages to print. In the served engines' children
    that thread polled without pause (17% of a core each and 54% of the GCS's, idle); joining
    stops it. Checked in a fresh process, as a child joins."""
    code = (
        "import sys, threading\n"
        "from kv_transfer.ray_cluster import join_ray\n"
        "join_ray(sys.argv[1], 'pdserve-test-join', sys.argv[2])\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, ray_cluster.address, ray_cluster.head_ip],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, **ray_auth_env(ray_cluster.token_path)},
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    threads = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert "MainThread" in threads and "ray_listen_error_messages" not in threads, threads
