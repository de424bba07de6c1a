"""Workloads: prompt and output lengths, shared prefix, offered rates and SLOs. What `pdserve
bench` sends (bench/workload.py makes the prompts) and what `pdserve plan` plans for.

A workload is a YAML file; the named ones live in deploy/workloads/ (`chat`, `long-prompt`,
`shared-prefix`). Lengths are fixed, uniform, or read from a JSONL trace whose lines are
{"prompt_tokens": int, "output_tokens": int} (cycled). Bench prompts are random dictionary
words of the target model's own tokenizer, fresh per request so no prefix-cache hit shortens a
prefill, except the `shared_prefix_tokens` every request starts with (a common system prompt).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"


class LengthDist(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["fixed", "uniform"] = Field(description="fixed: `value`; uniform: [low, high]")
    value: int | None = Field(None, ge=1, description="the length, for kind fixed")
    low: int | None = Field(None, ge=1, description="smallest length, for kind uniform")
    high: int | None = Field(None, ge=1, description="largest length, for kind uniform")

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.kind == "fixed" and self.value is None:
            raise ValueError("a fixed length needs `value`")
        if self.kind == "uniform" and (
            self.low is None or self.high is None or self.low > self.high
        ):
            raise ValueError("a uniform length needs `low` <= `high`")
        return self

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            assert self.value is not None
            return self.value
        assert self.low is not None and self.high is not None
        return rng.randint(self.low, self.high)


class WorkloadSLO(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_s: float = Field(gt=0, description="TTFT a request must meet, seconds")
    tpot_s: float = Field(gt=0, description="TPOT a request must meet, seconds")
    itl_s: float | None = Field(
        None,
        gt=0,
        description="P99 of a request's inter-token gaps it must meet, seconds (the TBT SLO of "
        "Sarathi-Serve and DynaServe: one long stall fails it, where a mean TPOT absorbs it); "
        "None: no ITL bound",
    )


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="how reports name it")
    description: str = Field("", description="one line for the report")
    prompt_tokens: LengthDist | None = Field(
        None, description="prompt length (after any shared prefix); or give `trace`"
    )
    output_tokens: LengthDist | None = Field(None, description="output length; or give `trace`")
    trace: Path | None = Field(None, description="JSONL of {prompt_tokens, output_tokens}")
    shared_prefix_tokens: int = Field(0, ge=0, description="a prefix every prompt shares")
    num_requests: int = Field(ge=1, description="requests per offered rate")
    low_load_requests: int = Field(
        4, ge=0, description="requests sent one at a time before the sweep (the overhead run)"
    )
    rates: list[float] = Field(min_length=1, description="offered Poisson rates, req/s")
    slo: WorkloadSLO

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if self.trace is None and (self.prompt_tokens is None or self.output_tokens is None):
            raise ValueError("give prompt_tokens and output_tokens, or a trace")
        if any(rate <= 0 for rate in self.rates):
            raise ValueError(f"rates must be > 0, got {self.rates}")
        return self

    def lengths(self, n: int, seed: int) -> list[tuple[int, int]]:
        """(prompt tokens after the shared prefix, output tokens) for n requests."""
        if self.trace is not None:
            rows = read_trace(self.trace)
            return [rows[i % len(rows)] for i in range(n)]
        assert self.prompt_tokens is not None and self.output_tokens is not None
        rng = random.Random(seed)
        return [(self.prompt_tokens.sample(rng), self.output_tokens.sample(rng)) for _ in range(n)]


def load_workload(name_or_path: str) -> Workload:
    """A named workload from deploy/workloads/, or a YAML file's path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = WORKLOADS_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise ValueError(f"unknown workload {name_or_path!r}; named ones: {workload_names()}")
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and data.get("trace") is not None:
        data["trace"] = (path.parent / data["trace"]).resolve()
    return Workload.model_validate(data)


def workload_names() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))


def read_trace(path: Path) -> list[tuple[int, int]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            lengths = (int(row["prompt_tokens"]), int(row["output_tokens"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}:{number}: want {{prompt_tokens, output_tokens}}: {exc}"
            ) from exc
        if min(lengths) < 1:
            raise ValueError(f"{path}:{number}: lengths must be >= 1, got {lengths}")
        rows.append(lengths)
    if not rows:
        raise ValueError(f"{path}: no requests in the trace")
    return rows
