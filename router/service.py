"""RouterService: one request from body to token stream, whatever the wire.

    body --validate--> ValidatedRequest --tokenize, fit--> GenerationRequest --admit--> engines
         <-- StreamChunk (text delta, ids, timings; usage on the last) <-- TokenEvent stream

The gRPC servicer and the OpenAI HTTP routes are thin adapters over `prepare` and `stream`.
`InvalidRequest` maps to INVALID_ARGUMENT / 400, `Overloaded` to RESOURCE_EXHAUSTED / 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine.messages import EngineRefused, GenerationRequest, TokenEvent, TokenLogprobs
from engine.prompts import NoChatTemplate, encode_chat, encode_text
from router.admission import (
    AdmissionLimits,
    AdmissionState,
    Rejected,
    admit,
    finish_prefill,
    release,
)
from router.auth import KeyLimits
from router.detokenizer import Detokenizer
from router.key_limits import KeyLimited, KeyLimiter, LocalKeyLimiter
from router.timings import RequestTimings, TimingClock
from router.validation import (
    InvalidRequest,
    RequestLimits,
    ValidatedRequest,
    fit_to_context,
    validate_request,
)


class Overloaded(Exception):
    """The admission limits are full: retry later (RESOURCE_EXHAUSTED / HTTP 429)."""


class DeadlineExceeded(TimeoutError):
    """A request ran past `router.request_timeout_s` (gRPC DEADLINE_EXCEEDED, HTTP 504)."""

    def __init__(self, request_id: str, num_delivered: int, timeout_s: float) -> None:
        super().__init__(
            f"request {request_id} ran past the router's {timeout_s:g} s limit "
            f"(router.request_timeout_s) after {num_delivered} tokens were delivered"
        )
        self.num_delivered = num_delivered


class EngineStream(Protocol):
    """The pools behind the router: disaggregated (prefill then decode) or colocated."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StreamChunk:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    timings: RequestTimings
    # Set on the last chunk only.
    usage: Usage | None = None
    # One entry per token of `token_ids` when the request asked for log-probabilities.
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its API key's name and limits (router/auth.py)."""

    name: str
    limits: KeyLimits


@dataclass(frozen=True)
class PreparedRequest:
    validated: ValidatedRequest
    request: GenerationRequest
    caller: Caller | None = None  # None: the app takes no keys


# "ok", "cancelled", "error", "timeout" (past router.request_timeout_s); refused before
# admission (no timings): "invalid" (400),
# "unauthenticated" (401), "too_large" (413), "overloaded" (429).
Outcome = str
FinishHook = Callable[[Outcome, RequestTimings | None, Usage], None]


# Prompts up to this many characters are tokenized on the event loop (well under a
# millisecond); longer ones (up to router.max_prompt_chars) in a worker thread.
INLINE_TOKENIZE_CHARS = 8192


def _num_chars(validated: ValidatedRequest) -> int:
    if validated.messages is None:
        return len(validated.prompt or "")
    return sum(len(m.content) for m in validated.messages)


class RouterService:
    def __init__(
        self,
        tokenizer: Any,
        limits: RequestLimits,
        admission: AdmissionLimits,
        max_model_len: int,
        engines: EngineStream,
        on_finish: FinishHook | None = None,
        replica_id: str = "",
        key_limiter: KeyLimiter | None = None,
        request_timeout_s: float = 600.0,
        openai_defaults: Mapping[str, float] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.admission = admission
        self.max_model_len = max_model_len
        self.engines = engines
        self._state = AdmissionState()
        self._on_finish = on_finish
        self.replica_id = replica_id  # this router replica, named in every request's timings
        self.key_limiter: KeyLimiter = key_limiter or LocalKeyLimiter()
        # Every request's whole stream, from admission to its last token, is bounded by this.
        self.request_timeout_s = request_timeout_s
        # Sampling defaults of OpenAI requests (vLLM's: the model's generation_config, else
        # temperature 1); gRPC requests default to greedy, as the proto says.
        self.openai_defaults: dict[str, float] = dict(openai_defaults or {})

    @property
    def num_in_flight(self) -> int:
        return self._state.num_in_flight

    def record_refusal(self, outcome: Outcome) -> None:
        """Count a request refused before it reached the engines (see `Outcome`)."""
        if self._on_finish is not None:
            self._on_finish(outcome, None, Usage(0, 0))

    def prepare(
        self, body: dict[str, Any], request_id: str = "", caller: Caller | None = None
    ) -> PreparedRequest:
        """Validate and tokenize here, on the caller's thread."""
        validated = validate_request(body, self.limits)
        return self._prepared(validated, self._tokenize(validated), request_id, caller)

    async def prepare_async(
        self, body: dict[str, Any], request_id: str = "", caller: Caller | None = None
    ) -> PreparedRequest:
        """`prepare` for the event loop: a prompt past INLINE_TOKENIZE_CHARS is tokenized in a
        worker thread, so one long prompt does not stall every stream of this router."""
        validated = validate_request(body, self.limits)
        if _num_chars(validated) <= INLINE_TOKENIZE_CHARS:
            prompt_ids = self._tokenize(validated)
        else:
            prompt_ids = await asyncio.to_thread(self._tokenize, validated)
        return self._prepared(validated, prompt_ids, request_id, caller)

    def _prepared(
        self,
        validated: ValidatedRequest,
        prompt_ids: list[int],
        request_id: str,
        caller: Caller | None,
    ) -> PreparedRequest:
        params = fit_to_context(validated, len(prompt_ids), self.max_model_len)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        request = GenerationRequest(request_id, tuple(prompt_ids), params)
        return PreparedRequest(validated, request, caller)

    def choices(self, prepared: PreparedRequest) -> list[PreparedRequest]:
        """One request per choice of `n` (OpenAI's parameter), as vLLM splits them: choice i is
        `<id>-<i>`, sampling with seed + i when the request has a seed. Each is admitted and
        counted as a request of its own."""
        n = prepared.validated.n
        if n == 1:
            return [prepared]
        request, seed = prepared.request, prepared.request.params.seed
        return [
            replace(
                prepared,
                request=replace(
                    request,
                    request_id=f"{request.request_id}-{i}",
                    params=replace(request.params, seed=None if seed is None else seed + i),
                ),
            )
            for i in range(n)
        ]

    def _tokenize(self, validated: ValidatedRequest) -> list[int]:
        # `add_special_tokens` unset: vLLM's default for each kind (prompts yes, chat no).
        special = validated.add_special_tokens
        if validated.messages is None:
            assert validated.prompt is not None
            return encode_text(
                self.tokenizer, validated.prompt, add_special_tokens=special is not False
            )
        messages = [{"role": m.role, "content": m.content} for m in validated.messages]
        try:
            return encode_chat(self.tokenizer, messages, add_special_tokens=special is True)
        except NoChatTemplate as exc:
            raise InvalidRequest("messages", str(exc)) from None

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[StreamChunk]:
        """The request's chunks, once its API key's limits (if any) and admission let it in;
        both raise Overloaded. Closing this stream cancels the request."""
        caller = prepared.caller
        limited = caller is not None and caller.limits.any
        if limited:
            assert caller is not None
            try:
                await self.key_limiter.acquire(
                    caller.name, caller.limits, prepared.request.request_id
                )
            except KeyLimited as exc:
                raise Overloaded(str(exc)) from None
        try:
            async with contextlib.aclosing(self._admitted(prepared)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if limited:
                assert caller is not None
                await self.key_limiter.release(caller.name, prepared.request.request_id)

    async def _admitted(self, prepared: PreparedRequest) -> AsyncGenerator[StreamChunk]:
        request = prepared.request
        clock = TimingClock(self.replica_id)
        decision = admit(self._state, self.admission, request.num_prompt_tokens)
        if isinstance(decision, Rejected):
            raise Overloaded(f"server is at capacity ({decision.reason}); retry later")
        self._state, ticket = decision.state, decision.ticket
        detok = Detokenizer(self.tokenizer, prepared.validated.stop)
        outcome: Outcome = "cancelled"
        try:
            events = self.engines.stream(request)
            deadline = asyncio.get_running_loop().time() + self.request_timeout_s
            try:
                while True:
                    # The bound covers each wait for the engines, never the caller's time with
                    # a chunk (a timeout must not cancel the consumer between two yields).
                    bound = asyncio.timeout_at(deadline)
                    try:
                        async with bound:
                            event = await anext(events)
                    except StopAsyncIteration:
                        break
                    except EngineRefused as exc:
                        # Before any token (vLLM checks a request as it adds it): a 400 naming
                        # the field, counted here as the refusal it is.
                        outcome = "invalid"
                        field = prepared.validated.structured_field or "body"
                        cause = getattr(exc, "cause", exc)  # Ray's task error: its cause
                        refused = InvalidRequest(field, f"refused by the engine: {cause}")
                        refused.counted = True
                        raise refused from exc
                    except TimeoutError:
                        if not bound.expired():
                            raise  # the engines' own, not this bound
                        outcome = "timeout"
                        raise DeadlineExceeded(
                            request.request_id, clock.num_tokens, self.request_timeout_s
                        ) from None
                    if event.is_first:
                        self._state, ticket = finish_prefill(self._state, ticket)
                        clock.prefill_done(clock.since_arrival(), event.prefill_seconds)
                    if event.replica_id:
                        clock.served_by(event.replica_id, prefill=event.is_first)
                    if event.is_decode_start:
                        clock.decode_started()
                        continue
                    if not event.is_first and clock.num_tokens == 1 and event.token_ids:
                        clock.first_decode_token(None)
                    text, finish = detok.push(event.token_ids, event.finish_reason)
                    clock.tokens_sent(len(event.token_ids))
                    if finish is not None:
                        timings = clock.finish()
                        outcome = "ok"
                        usage = Usage(request.num_prompt_tokens, clock.num_tokens)
                        yield StreamChunk(
                            request.request_id,
                            text,
                            event.token_ids,
                            finish,
                            timings,
                            usage,
                            event.logprobs,
                        )
                        return
                    yield StreamChunk(
                        request.request_id,
                        text,
                        event.token_ids,
                        None,
                        clock.snapshot(),
                        logprobs=event.logprobs,
                    )
                outcome = "error"  # the engines ended the stream without a finish reason
                raise RuntimeError(f"request {request.request_id} ended without a finish reason")
            finally:
                await events.aclose()  # type: ignore[attr-defined]
        except Exception:
            if outcome not in ("timeout", "invalid"):
                outcome = "error"
            raise
        finally:
            self._state = release(self._state, ticket)
            if self._on_finish is not None:
                self._on_finish(
                    outcome,
                    clock.finish() if outcome == "ok" else None,
                    Usage(request.num_prompt_tokens, clock.num_tokens),
                )
