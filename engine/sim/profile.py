"""Sim profiles: how long one engine step takes, how big the KV is, how fast links move it.

Profiles are data files (`profiles/<name>.json`), each citing its sources. A step's time is a
linear model over what vLLM batches in that step (a chunk of prompt is "prefill", one token of a
running sequence is "decode"):

    step_s = base_s                                   weights read once per step
           + prefill_token_s     x prefill tokens     GEMMs of the prompt chunks
           + prefill_attention_s x sum(chunk x (context before it + chunk / 2))
           + decode_seq_s        x decode sequences   GEMMs of one token per sequence
           + decode_context_s    x sum(decode contexts)  attention reads the KV

A step with nothing scheduled takes no time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).parent / "profiles"
LINKS_FILE = PROFILE_DIR / "links.json"


@dataclass(frozen=True)
class StepCosts:
    base_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_attention_s: float = 0.0
    decode_seq_s: float = 0.0
    decode_context_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"step cost {name} must be >= 0, got {value}")


@dataclass(frozen=True)
class Link:
    """A KV transfer path: one-way bandwidth and a fixed per-transfer latency."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0")

    def transfer_seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class SimProfile:
    name: str
    step: StepCosts
    # KV shape of the profiled model (per engine, all tensor-parallel ranks together).
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    # KV cache per engine; None: the engine settings' kv_cache_memory_bytes (CPU profiles).
    kv_cache_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    default_link: str = "tcp"

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 x layers x KV heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def num_blocks(self, block_size: int, fallback_cache_bytes: int | None) -> int:
        cache = self.kv_cache_bytes or fallback_cache_bytes
        if not cache:
            raise ValueError(f"sim profile {self.name}: no KV cache size (kv_cache_bytes)")
        return max(1, cache // (block_size * self.kv_bytes_per_token))

    def step_seconds(
        self,
        prefill_chunks: list[tuple[int, int]],
        decode_contexts: list[int],
    ) -> float:
        """Duration of one step: `prefill_chunks` as (context before, chunk tokens),
        `decode_contexts` the context length of each decoding sequence."""
        if not prefill_chunks and not decode_contexts:
            return 0.0
        c = self.step
        num_prefill = sum(n for _, n in prefill_chunks)
        attention = sum(n * (before + n / 2) for before, n in prefill_chunks)
        return (
            c.base_s
            + c.prefill_token_s * num_prefill
            + c.prefill_attention_s * attention
            + c.decode_seq_s * len(decode_contexts)
            + c.decode_context_s * sum(decode_contexts)
        )

    def request_seconds(
        self, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0
    ) -> float:
        """The least compute one request costs, summed over the steps it is in, without any
        step's `base_s` (which its batch shares): its uncached prompt tokens and their attention
        (the same however the prompt is chunked), then a decode token for each output after
        the first (which the prompt's last step gives) at its context. Preemption, a KV pull's
        recomputed last position and shared steps only add to it, so N engines finish at most
        N / (the mean of this) requests a second of a workload, whatever the topology."""
        if not 0 <= cached_tokens <= prompt_tokens or output_tokens < 0:
            raise ValueError(
                f"need 0 <= cached_tokens <= prompt_tokens and output_tokens >= 0, got "
                f"{cached_tokens}, {prompt_tokens}, {output_tokens}"
            )
        c = self.step
        new = prompt_tokens - cached_tokens
        decodes = max(0, output_tokens - 1)
        # Contexts prompt + 1 ... prompt + decodes: the scheduler's `decode_contexts`.
        contexts = decodes * prompt_tokens + decodes * (decodes + 1) // 2
        return (
            c.prefill_token_s * new
            + c.prefill_attention_s * new * (cached_tokens + new / 2)
            + c.decode_seq_s * decodes
            + c.decode_context_s * contexts
        )


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json") if p != LINKS_FILE)


def load_profile(name: str) -> SimProfile:
    path = PROFILE_DIR / f"{name}.json"
    if name == LINKS_FILE.stem or not path.is_file():
        raise ValueError(f"unknown sim profile {name!r}; known: {', '.join(profile_names())}")
    return profile_from_dict(json.loads(path.read_text()))


def profile_from_dict(raw: dict[str, Any]) -> SimProfile:
    kv = raw["kv"]
    return SimProfile(
        name=raw["name"],
        step=StepCosts(**raw["step"]),
        num_layers=int(kv["num_layers"]),
        num_kv_heads=int(kv["num_kv_heads"]),
        head_dim=int(kv["head_dim"]),
        kv_dtype_bytes=int(kv["dtype_bytes"]),
        kv_cache_bytes=raw.get("kv_cache_bytes"),
        max_num_batched_tokens=int(raw.get("max_num_batched_tokens", 2048)),
        default_link=raw.get("default_link", "tcp"),
    )


def load_link(name: str) -> Link:
    links = json.loads(LINKS_FILE.read_text())["links"]
    if name not in links:
        raise ValueError(f"unknown sim link {name!r}; known: {', '.join(sorted(links))}")
    entry = links[name]
    return Link(name, float(entry["bandwidth_bytes_per_s"]), float(entry.get("latency_s", 0.0)))
