"""Service-time models of one replica, fitted from measurements or written down for a GPU.

    prefill batch time = a + b * sum(prompt tokens) + q * sum(prompt tokens^2)   (attention)
    decode step time   = c + d * batch size + e * total context tokens in the batch

`CPU_FP32_1CORE` / `CPU_BF16_1CORE` are fitted to FIELD-NOTES (SmolLM2-135M, vLLM on one core):
the prefill terms go through the 512- and 2,048-token points with a 20 ms / 10 ms floor; c and
d through batch 16 and 64 of 128 tokens, with e from the memory roofline (~46 KB of fp32 KV per
token at ~7 GB/s) and its share at ~150 context tokens taken out of d. KV capacity is the
default 256 MiB cache (~5,700 fp32 tokens). `GPU_LIKE` is illustrative, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceProfile:
    """How fast one prefill or decode replica works, and how long it takes to start."""

    name: str
    prefill_base_s: float
    prefill_s_per_token: float
    prefill_s_per_token_sq: float
    prefill_max_batch_tokens: int
    decode_base_s: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    decode_max_num_seqs: int
    kv_capacity_tokens: int
    startup_s: float
    # KV handoff from prefill to decode, per prompt token (FIELD-NOTES: ~2-3 GB/s over NIXL).
    transfer_s_per_token: float = 1e-5

    def __post_init__(self) -> None:
        if self.prefill_max_batch_tokens < 1 or self.decode_max_num_seqs < 1:
            raise ValueError("batch limits must be >= 1")
        if self.kv_capacity_tokens < 1 or self.startup_s < 0:
            raise ValueError("kv_capacity_tokens must be >= 1 and startup_s >= 0")

    def prefill_batch_s(self, num_tokens: int, num_tokens_sq: int) -> float:
        return (
            self.prefill_base_s
            + self.prefill_s_per_token * num_tokens
            + self.prefill_s_per_token_sq * num_tokens_sq
        )

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_batch_s(prompt_tokens, prompt_tokens * prompt_tokens)


CPU_FP32_1CORE = ServiceProfile(
    name="cpu-fp32-1core",
    prefill_base_s=0.02,
    prefill_s_per_token=1.673e-3,
    prefill_s_per_token_sq=2.797e-7,
    prefill_max_batch_tokens=2048,
    decode_base_s=0.056,
    decode_s_per_seq=2.25e-3,
    decode_s_per_context_token=6.6e-6,
    decode_max_num_seqs=64,
    kv_capacity_tokens=5696,
    startup_s=45.0,
)

CPU_BF16_1CORE = ServiceProfile(
    name="cpu-bf16-1core",
    prefill_base_s=0.01,
    prefill_s_per_token=4.35e-4,
    prefill_s_per_token_sq=1.049e-7,
    prefill_max_batch_tokens=2048,
    decode_base_s=0.039,
    decode_s_per_seq=0.6e-3,
    decode_s_per_context_token=3.3e-6,
    decode_max_num_seqs=64,
    kv_capacity_tokens=11392,
    startup_s=45.0,
)

GPU_LIKE = ServiceProfile(
    name="gpu-like",
    prefill_base_s=0.01,
    prefill_s_per_token=6e-5,
    prefill_s_per_token_sq=2e-9,
    prefill_max_batch_tokens=8192,
    decode_base_s=0.012,
    decode_s_per_seq=1e-4,
    decode_s_per_context_token=2e-8,
    decode_max_num_seqs=256,
    kv_capacity_tokens=400_000,
    startup_s=90.0,
    transfer_s_per_token=1e-6,
)

PROFILES = {p.name: p for p in (CPU_FP32_1CORE, CPU_BF16_1CORE, GPU_LIKE)}
