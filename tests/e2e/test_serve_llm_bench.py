"""`pdserve bench run --systems ray-serve-llm`: Ray Serve LLM's P/D app (`build_pd_openai_app`,
vLLM's NIXL connector on CPU) started on its own Ray head, measured over OpenAI HTTP, and
stopped with nothing left running. In a subprocess, as a user runs it: the system starts and
shuts down a Ray of its own, which must not touch this session's.

The default model, not the tiny one: the HTTP target counts streamed text, and the tiny model's
random tokens are mostly partial UTF-8 that vLLM streams as no text at all."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.report import Report
from tests.builders import small_chat_workload

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        importlib.util.find_spec("pyarrow") is None,
        reason="Ray Serve LLM needs the serve-llm extra: pip install -e '.[serve-llm]'",
    ),
]

WORKLOAD = small_chat_workload(num_requests=3)


def test_ray_serve_llm_serves_a_benchmark(tmp_path: Path) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump(WORKLOAD.model_dump(mode="json")))
    out = tmp_path / "report"
    run = subprocess.run(
        [
            sys.executable, "-m", "pdserve_cli", "bench", "run", "--systems", "ray-serve-llm",
            "--model", "default", "--workload", str(workload), "--warmup", "1",
            "--out", str(out), "--no-progress",
        ],
        capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    report = Report.load(out / "report.json")
    assert [(r.system, r.arrival.label, r.summary.num_completed) for r in report.runs] == [
        ("ray-serve-llm", "1 in flight", 2),
        ("ray-serve-llm", "1 req/s", 3),
    ]
    for record in (record for r in report.runs for record in r.records):
        assert record.ok, record.error
        # ignore_eos: exactly max_tokens, counted from the stream's usage chunk.
        assert record.num_output_tokens == 8
        assert record.ttft_s is not None and record.e2e_s is not None
        assert 0 < record.ttft_s <= record.e2e_s
