"""A short real benchmark: the disaggregated and colocated apps of this session (gRPC through
Serve's proxy) and a bare AsyncLLM in this process, one small workload, into a complete report
(JSON, markdown, PNGs) whose numbers agree with what the servers say about themselves."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import yaml

from api.client import API_KEY_ENV
from bench.compare import compare
from bench.record import RequestRecord
from bench.report import Report
from bench.runner import Arrival, run_load
from bench.suite import BenchPlan, run_benchmark
from bench.systems import start_system
from bench.targets import GrpcTarget, HttpTarget, Target
from bench.workload import build_requests
from engine.prompts import load_tokenizer
from tests.builders import small_chat_workload
from tests.e2e.conftest import ServedApp

pytestmark = pytest.mark.engine

WORKLOAD = small_chat_workload(num_requests=4)


@contextmanager
def running(target: Target) -> Iterator[Target]:
    yield target


def test_short_run_produces_a_complete_report(
    serve_apps: dict[str, ServedApp], tiny_model: Path, tmp_path: Path
) -> None:
    pd, colocated = serve_apps["nixl"], serve_apps["colocated"]
    systems = [
        partial(running, GrpcTarget("disaggregated", pd.grpc_target, pd.name, pd.api_key)),
        partial(running, GrpcTarget("colocated", colocated.grpc_target, colocated.name)),
        partial(start_system, "engine", pd.config),
    ]
    plan = BenchPlan(workloads=[WORKLOAD], num_warmup=1, progress=False)
    tokenizer = load_tokenizer(str(tiny_model))
    report, paths = run_benchmark(plan, systems, tokenizer, tmp_path, {"model": "tiny"})

    assert [(r.system, r.arrival.label) for r in report.runs] == [
        (system, load)
        for system in ("disaggregated", "colocated", "engine")
        for load in ("1 in flight", "1 req/s")
    ]
    for run in report.runs:
        for record in run.records:
            assert record.ok, (run.system, record.error)
            assert record.num_output_tokens == 8  # ignore_eos: exactly max_tokens
            assert record.ttft_s is not None and record.e2e_s is not None
            assert 0 < record.ttft_s <= record.e2e_s
            if run.system == "engine":
                assert record.server is None
            else:
                # The router's clock starts after the client's and stops before it.
                assert record.server is not None
                assert record.server.ttft_s <= record.ttft_s + 1e-3
                assert record.server.prefill_s <= record.server.ttft_s
        summary = run.summary
        assert summary.num_completed >= summary.num_sent - 1
        assert summary.output_token_throughput > 0
        assert summary.cost_per_million_output_tokens is not None

    # The files: JSON that reloads to the same numbers, markdown with every run, two PNGs.
    assert {p.name for p in paths} == {
        "report.json", "report.md", "tiny-chat-cdf.png", "tiny-chat-vs-rate.png"
    }  # fmt: skip
    reloaded = Report.load(tmp_path / "report.json")
    assert [r.summary for r in reloaded.runs] == [r.summary for r in report.runs]
    assert json.loads((tmp_path / "report.json").read_text())["meta"]["model"] == "tiny"
    table = (tmp_path / "report.md").read_text()
    assert (
        sum(
            line.startswith(("| disaggregated |", "| colocated |", "| engine |"))
            for line in table.splitlines()
        )
        == 6 + 4
    )  # latency rows + per-hop rows
    (comparison,) = compare(report)
    ratios = {r.what: r.ratio for r in comparison.ratios}
    assert comparison.low_load == "1 in flight"
    assert ratios["TTFT P50 disaggregated / engine"] is not None
    assert ratios["TTFT P50 disaggregated / engine"] > 0


def test_http_target_counts_tokens_from_usage(
    serve_apps: dict[str, ServedApp], tiny_model: Path
) -> None:
    pd = serve_apps["nixl"]
    requests = build_requests(WORKLOAD, load_tokenizer(str(tiny_model)), 3, seed=7)
    target = HttpTarget("http", pd.openai_base, api_key=pd.api_key)

    async def go() -> list[RequestRecord]:
        try:
            return await run_load(target, requests, Arrival("closed", 1), progress=False)
        finally:
            await target.close()

    records = asyncio.run(go())
    assert [r.error for r in records] == [None] * 3
    assert [r.num_output_tokens for r in records] == [8, 8, 8]
    assert all(r.ttft_s is not None and r.tpot_s is not None for r in records)


def test_cli_run_against_a_running_app_then_compare(
    serve_apps: dict[str, ServedApp], tmp_path: Path
) -> None:
    pd = serve_apps["nixl"]
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump(WORKLOAD.model_dump(mode="json")))
    out = tmp_path / "report"
    assert pd.api_key  # the CLI reads it from the environment, as a user's shell would pass it
    run = subprocess.run(
        [
            sys.executable, "-m", "pdserve_cli", "bench", "run", "--target", pd.grpc_target,
            "--app", pd.name, "--label", "disaggregated", "--model", "tiny",
            "--workload", str(workload), "--warmup", "1", "--out", str(out), "--no-progress",
        ],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, API_KEY_ENV: pd.api_key},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = Report.load(out / "report.json")
    assert [(r.system, r.summary.num_completed) for r in report.runs] == [
        ("disaggregated", 2), ("disaggregated", 4)
    ]  # fmt: skip
    assert "| disaggregated | 1 req/s | 4/4 |" in (out / "report.md").read_text()
    compared = subprocess.run(
        [sys.executable, "-m", "pdserve_cli", "bench", "compare", str(out / "report.json")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    # One system: nothing to divide by, and the command says so rather than inventing a ratio.
    assert compared.stdout.splitlines() == [
        "tiny-chat",
        "  no ratios: they need runs of disaggregated beside engine or colocated",
    ]
