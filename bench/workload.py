"""Benchmark workloads: prompt and output lengths, shared prefix, offered rates and SLOs.

A workload is a YAML file; the named ones live in bench/workloads/ (`chat`, `long-prompt`,
`shared-prefix`). Lengths are fixed, uniform, or read from a JSONL trace whose lines are
{"prompt_tokens": int, "output_tokens": int} (cycled). Prompts are random dictionary words of
the target model's own tokenizer, fresh per request so no prefix-cache hit shortens a prefill,
except the `shared_prefix_tokens` every request starts with (a common system prompt).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
    """A named workload from bench/workloads/, or a YAML file's path."""
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


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str
    prompt_tokens: int  # as the model's tokenizer counts the prompt (special tokens included)
    max_tokens: int


_WORD = re.compile(r"^ [a-z]{3,12}$")


class PromptMaker:
    """Random-word prompts of an exact token count for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        words = [i for i in sorted(vocab.values()) if _WORD.match(tokenizer.decode([i]))]
        if len(words) < 100:  # a tiny test tokenizer: any printable, non-special token
            special = set(tokenizer.all_special_ids)
            words = [
                i
                for i in sorted(vocab.values())
                if i not in special and tokenizer.decode([i]).isprintable()
            ]
        self._words = words

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """Text of exactly `num_tokens` tokens (no special tokens), or as close as decoding
        round trips allow."""
        ids = [rng.choice(self._words) for _ in range(num_tokens)]
        text = self._tokenizer.decode(ids)
        again = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(again) > num_tokens:
            text = self._tokenizer.decode(again[:num_tokens])
        return str(text)

    def count(self, text: str) -> int:
        return len(self._tokenizer(text)["input_ids"])


def build_requests(
    workload: Workload, tokenizer: Any, num_requests: int, seed: int = 0, prefix_seed: int = 0
) -> list[BenchRequest]:
    """Fresh prompts for each `seed`; the shared prefix depends on `prefix_seed` only, so every
    batch of one benchmark shares it (a system prompt in steady state)."""
    maker = PromptMaker(tokenizer)
    prefix = ""
    if workload.shared_prefix_tokens:
        prefix = maker.text(workload.shared_prefix_tokens, random.Random(prefix_seed))
    rng = random.Random(seed)
    requests = []
    for index, (prompt_len, output_len) in enumerate(workload.lengths(num_requests, seed)):
        prompt = prefix + maker.text(prompt_len, rng)
        requests.append(BenchRequest(index, prompt, maker.count(prompt), output_len))
    return requests
