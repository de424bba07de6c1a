"""A sim profile's step costs measured with plain PyTorch (issue 15): a Llama-shaped decoder with
random weights, timed on whatever device is at hand, fitted to engine/sim/profile.py's step
model and set beside a shipped profile's prediction for the same steps.

    python -m engine.sim.torch_profile --device cuda --shape llama2-7b --dtype bfloat16 \
        --compare h100-llama2-7b --out /tmp/h100-measured.json

What is timed (each the median of `--repeats` after warm-up, the device synchronized):
- prefill: one sequence of T tokens through every layer (RMSNorm, fused QKV, rotary
  embedding, causal scaled-dot-product attention, output projection, SwiGLU MLP), then the
  final norm and the LM head for its last token;
- decode: B sequences of one token each, attending to C cached tokens apiece, the LM head for
  all B. One KV tensor stands in for every layer's cache (each layer reads all of it, as many
  bytes as its own would be; at every (B, C) timed it is larger than a GPU's L2), so a decode
  grid fits in memory that 32 caches would not.

Then one least-squares fit, on relative error, of

    prefill(T)   = base + prefill_token x T + prefill_attention x T^2 / 2
    decode(B, C) = base + decode_seq x B + decode_context x B x C

(the shared base: the weights read once per step), written as a profile's "step" object.
What it leaves out, as the shipped GPU profiles do: vLLM's paged KV and its CPU-side step
(scheduling, sampling, detokenization), CUDA graphs, and writing the new tokens' KV.

Needs only torch (and this package's stdlib-only profile module), so it runs on a machine that
has PyTorch and no vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from engine.sim.profile import SimProfile, StepCosts, load_profile


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


SHAPES = {
    # meta-llama/Llama-2-7b-hf's config.json: the model of the h100-llama2-7b profile.
    "llama2-7b": Shape(32, 4096, 32, 32, 11008, 32000),
    # meta-llama/Meta-Llama-3-8B's config.json.
    "llama3-8b": Shape(32, 4096, 32, 8, 14336, 128256),
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json: the model of the cpu profiles.
    "smollm2-135m": Shape(30, 576, 9, 3, 1536, 49152),
    # For tests: seconds on one CPU core.
    "tiny": Shape(2, 128, 4, 2, 256, 512),
}
PREFILL_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 1024, 2048, 4096)
MAX_DECODE_KV_TOKENS = 256 * 1024  # B x C: at most 4.3 GB of llama2-7b's KV in the one tensor


@dataclass(frozen=True)
class Measurements:
    prefill_s: dict[int, float]  # tokens -> seconds
    decode_s: dict[tuple[int, int], float]  # (batch, context) -> seconds


class RandomLlama:
    """A Llama decoder's forward passes with random weights (no checkpoint: timing only)."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0):
        self.shape, self.dtype, self.device = shape, dtype, device
        gen = torch.Generator(device=device).manual_seed(seed)
        d, h = shape.head_dim, shape.hidden

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.empty(rows, cols, dtype=dtype, device=device)
            return w.normal_(0.0, 0.02, generator=gen)

        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
        self.layers = [
            (
                weight(h, qkv),
                weight(shape.num_heads * d, h),
                weight(h, 2 * shape.intermediate),
                weight(shape.intermediate, h),
            )
            for _ in range(shape.num_layers)
        ]
        self.norm = torch.ones(h, dtype=dtype, device=device)
        self.embed = weight(shape.vocab, h)
        self.lm_head = weight(h, shape.vocab)
        # Grouped-query attention without copying K and V per query head (torch >= 2.5); an
        # MHA shape passes nothing, so it runs on older torch too.
        self._gqa = {"enable_gqa": True} if shape.num_kv_heads != shape.num_heads else {}

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.shape.head_dim // 2
        inv = 1.0 / (10000 ** (torch.arange(half, device=self.device, dtype=torch.float32) / half))
        angles = positions.to(torch.float32)[:, None] * inv[None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim / 2]
        a, b = x.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + 1e-5)).to(self.dtype) * self.norm

    def _layer(
        self,
        weights: tuple[torch.Tensor, ...],
        x: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        s = self.shape
        w_qkv, w_o, w_gate_up, w_down = weights
        d, n_q, n_kv = s.head_dim, s.num_heads, s.num_kv_heads
        qkv = self._norm(x) @ w_qkv
        q = qkv[:, : n_q * d].view(-1, n_q, d)
        k = qkv[:, n_q * d : (n_q + n_kv) * d].view(-1, n_kv, d)
        v = qkv[:, (n_q + n_kv) * d :].view(-1, n_kv, d)
        cos, sin = self._rotary(positions)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        x = x + attend(q, k, v).reshape(-1, n_q * d) @ w_o
        gate, up = (self._norm(x) @ w_gate_up).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ w_down

    def prefill(self, num_tokens: int) -> torch.Tensor:
        """One prompt of `num_tokens`, causal attention over itself; logits of its last token."""
        s = self.shape
        ids = torch.randint(0, s.vocab, (num_tokens,), device=self.device)
        positions = torch.arange(num_tokens, device=self.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                **self._gqa,
            )
            return out[0].transpose(0, 1)

        x = self.embed[ids]
        for weights in self.layers:
            x = self._layer(weights, x, positions, attend)
        return self._norm(x[-1:]) @ self.lm_head

    def decode(self, batch: int, context: int, cache: tuple[torch.Tensor, torch.Tensor]) -> Any:
        """One token for each of `batch` sequences, each attending to `context` cached tokens
        (`cache`: K and V of shape [batch, kv heads, context, head_dim], read by every layer)."""
        s = self.shape
        ids = torch.randint(0, s.vocab, (batch,), device=self.device)
        positions = torch.full((batch,), context, device=self.device)
        k_cache, v_cache = cache

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q[:, :, None, :],  # [batch, heads, 1, head_dim]
                k_cache,
                v_cache,
                **self._gqa,
            )
            return out[:, :, 0, :]

        x = self.embed[ids]
        for weights in self.layers:
            x = self._layer(weights, x, positions, attend)
        return self._norm(x) @ self.lm_head

    def new_cache(self, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        size = (batch, s.num_kv_heads, context, s.head_dim)
        return (
            torch.randn(size, dtype=self.dtype, device=self.device),
            torch.randn(size, dtype=self.dtype, device=self.device),
        )


def time_call(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of `fn`, the device synchronized around each call."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    model: RandomLlama,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    decode_batches: Sequence[int] = DECODE_BATCHES,
    decode_contexts: Sequence[int] = DECODE_CONTEXTS,
    max_decode_kv_tokens: int = MAX_DECODE_KV_TOKENS,
    repeats: int = 5,
    warmup: int = 2,
    log: Callable[[str], None] = lambda _: None,
) -> Measurements:
    prefill: dict[int, float] = {}
    decode: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        for n in prefill_tokens:
            prefill[n] = time_call(partial(model.prefill, n), model.device, repeats, warmup)
            log(f"prefill {n} tokens: {prefill[n] * 1e3:.2f} ms")
        for context in decode_contexts:
            for batch in decode_batches:
                if batch * context > max_decode_kv_tokens:
                    continue
                cache = model.new_cache(batch, context)
                decode[batch, context] = time_call(
                    partial(model.decode, batch, context, cache),
                    model.device,
                    repeats,
                    warmup,
                )
                del cache
                log(f"decode {batch} x {context}: {decode[batch, context] * 1e3:.2f} ms")
    return Measurements(prefill, decode)


def design_rows(m: Measurements) -> tuple[list[list[float]], list[float]]:
    """The fit's rows, unknowns (base, prefill_token, prefill_attention, decode_seq,
    decode_context), and the measured seconds of each."""
    rows = [[1.0, n, n * n / 2, 0.0, 0.0] for n in m.prefill_s]
    rows += [[1.0, 0.0, 0.0, b, b * c] for b, c in m.decode_s]
    return rows, [*m.prefill_s.values(), *m.decode_s.values()]


def fit(m: Measurements) -> StepCosts:
    """Least squares on relative error (each row over its own seconds, so a 10 ms decode step
    weighs as much as a 1 s prefill); a negative coefficient is clipped to 0."""
    rows, seconds = design_rows(m)
    a = torch.tensor([[x / t for x in row] for row, t in zip(rows, seconds, strict=True)])
    b = torch.ones(len(rows), 1, dtype=a.dtype)
    solution = torch.linalg.lstsq(a.double(), b.double()).solution[:, 0].tolist()
    base, token, attention, seq, context = (max(0.0, x) for x in solution)
    return StepCosts(base, token, attention, seq, context)


def predicted(profile: SimProfile, m: Measurements) -> Measurements:
    """`profile`'s step time for each measured step."""
    return Measurements(
        {n: profile.step_seconds([(0, n)], []) for n in m.prefill_s},
        {(b, c): profile.step_seconds([], [c] * b) for b, c in m.decode_s},
    )


def comparison(measured: Measurements, reference: Measurements) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n, t in measured.prefill_s.items():
        rows.append(_row(f"prefill {n}", t, reference.prefill_s[n]))
    for (b, c), t in measured.decode_s.items():
        rows.append(_row(f"decode {b} x {c}", t, reference.decode_s[b, c]))
    return rows


def _row(step: str, measured_s: float, reference_s: float) -> dict[str, Any]:
    ratio = measured_s / reference_s if reference_s else math.inf
    return {"step": step, "measured_s": measured_s, "reference_s": reference_s, "ratio": ratio}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--compare", help="a shipped sim profile to set beside the measurement")
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=list(PREFILL_TOKENS))
    parser.add_argument("--decode-batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=list(DECODE_CONTEXTS))
    parser.add_argument("--max-decode-kv-tokens", type=int, default=MAX_DECODE_KV_TOKENS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch CPU threads (CPU devices)")
    parser.add_argument("--out", help="write the report (JSON) here too")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = load_profile(args.compare) if args.compare else None  # unknown names fail early
    device = torch.device(args.device)
    shape = SHAPES[args.shape]

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    model = RandomLlama(shape, getattr(torch, args.dtype), device)
    m = measure(
        model,
        args.prefill_tokens,
        args.decode_batches,
        args.decode_contexts,
        args.max_decode_kv_tokens,
        args.repeats,
        args.warmup,
        log,
    )
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "dtype": args.dtype,
        "prefill_s": {str(n): t for n, t in m.prefill_s.items()},
        "decode_s": {f"{b}x{c}": t for (b, c), t in m.decode_s.items()},
        "step": asdict(fit(m)),
    }
    if reference is not None:
        steps = comparison(m, predicted(reference, m))
        report["compare"] = {
            "profile": reference.name,
            "step": asdict(reference.step),
            "steps": steps,
        }
        log(f"{'step':<22} {'measured ms':>12} {reference.name + ' ms':>24} {'ratio':>6}")
        for row in steps:
            log(
                f"{row['step']:<22} {row['measured_s'] * 1e3:>12.2f} "
                f"{row['reference_s'] * 1e3:>24.2f} {row['ratio']:>6.2f}"
            )
    log("fitted step: " + ", ".join(f"{k} {v:.4g}" for k, v in report["step"].items()))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
