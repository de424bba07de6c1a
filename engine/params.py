"""Per-request generation parameters, validated once where a request enters pdserve."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOKENS_LIMIT = 32_768
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Constrained decoding, as vLLM's StructuredOutputsParams: exactly one constraint. `json` is
    a JSON schema (serialized), `json_object` any JSON object, `regex` a regular expression,
    `choice` one of some strings, `grammar` an EBNF (or Lark) grammar."""

    kind: str
    spec: str | tuple[str, ...] | bool

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}")
        expected = {"json_object": bool, "choice": tuple}.get(self.kind, str)
        if not isinstance(self.spec, expected):
            raise ValueError(f"structured output {self.kind} takes a {expected.__name__}")

    def vllm_kwargs(self) -> dict[str, object]:
        """StructuredOutputsParams' keyword arguments."""
        return {self.kind: list(self.spec) if isinstance(self.spec, tuple) else self.spec}


@dataclass(frozen=True)
class GenerationParams:
    """What to generate. Greedy when `temperature` is 0; `seed` makes sampling repeatable."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    # vLLM's other sampling controls, with vLLM's neutral defaults.
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    # Log-probabilities of each sampled token and of this many most likely ones (None: none).
    logprobs: int | None = None
    # Constrained decoding (None: none). Both pools get it: prefill samples the first token
    # under it, decode re-samples that token under it and goes on.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(
                f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
