"""In-process fakes of the router's ports, for millisecond tests of the request lifecycle and
`RouterService` (mini-sglang's offline mode, in spirit): a prefill pool, a decode pool and a
tokenizer with one token per character. Gates (`asyncio.Event`) hold a call where a test wants
to cancel it; every handoff made, decoded and released is recorded for the ownership checks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.messages import (
    GenerationRequest,
    KVHandoff,
    KVLayout,
    KVTransferError,
    PrefillResult,
    RayPull,
    ReplicaFailure,
    TokenEvent,
)
from engine.params import GenerationParams
from router.lifecycle import generate_disaggregated

LAYOUT = KVLayout("fake", "digest", "float32", 32, 2, 2, 16)


class FakeTokenizer:
    """One token per character (id = code point); a chat template of role tags."""

    chat_template: str | None = "<role>content"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(char) for char in text]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        turns = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return turns + ("<assistant>" if add_generation_prompt else "")


def ids(text: str) -> tuple[int, ...]:
    return tuple(ord(char) for char in text)


def make_request(
    prompt: str = "hello", request_id: str = "req-1", **params: Any
) -> GenerationRequest:
    return GenerationRequest(request_id, ids(prompt), GenerationParams(**params))


def _num_delivered(seen: list[GenerationRequest], request: GenerationRequest) -> int:
    """How many answer tokens a moved request ("<id>~<n>", router/lifecycle.py) carries: its
    prompt's length past that of the request it moves (0 for a request not moved)."""
    root = request.request_id.split("~")[0]
    base = next((r for r in seen if r.request_id == root), request)
    return request.num_prompt_tokens - base.num_prompt_tokens


class FakePrefill:
    """The prefill pool: answers with `first` as the first token and a fresh handoff.

    `gate`: the call waits for it (a cancel can land meanwhile). `error`: raised instead of a
    result (by the first `fail_times` calls; None: by all). `abort_fails_prefill`: an abort
    makes the waiting call fail, as an engine that drops the request before its KV is stored;
    otherwise the call finishes anyway. `then`: the answer after `first`, so a moved request
    (its prompt plus the tokens delivered) gets the answer's next token first.
    """

    def __init__(
        self,
        first: str = "W",
        finish_reason: str | None = None,
        *,
        gate: asyncio.Event | None = None,
        error: Exception | None = None,
        fail_times: int | None = None,
        abort_fails_prefill: bool = False,
        then: str = "orld",
    ) -> None:
        self.first = first
        self.answer = first + then
        self.fail_times = fail_times
        self.finish_reason = finish_reason
        self.gate = gate
        self.error = error
        self.abort_fails_prefill = abort_fails_prefill
        self.requests: list[GenerationRequest] = []
        self.handoffs: list[KVHandoff] = []
        self.aborted: list[str] = []
        self.avoided: list[frozenset[str]] = []
        self.started = asyncio.Event()

    async def prefill(
        self, request: GenerationRequest, avoid: frozenset[str] = frozenset()
    ) -> PrefillResult:
        self.requests.append(request)
        self.avoided.append(avoid)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None and (
            self.fail_times is None or len(self.requests) <= self.fail_times
        ):
            raise self.error
        if request.request_id in self.aborted and self.abort_fails_prefill:
            raise KVTransferError(f"{request.request_id} aborted before its KV was stored")
        position = _num_delivered(self.requests, request)
        handoff = KVHandoff(
            backend="ray",
            producer_id="prefill-0",
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            first_token=ord(self.answer[position]),
            layout=LAYOUT,
            lease_expires_at=time.time() + 60,
            pull=RayPull.from_producer_params({"key": request.request_id}),
        )
        self.handoffs.append(handoff)
        last = position == len(self.answer) - 1
        finish_reason = self.finish_reason or ("length" if last else None)
        return PrefillResult(handoff, finish_reason, prefill_seconds=0.001)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeDecode:
    """The decode pool: streams `text` one token per event, the last with `finish_reason`.

    `gate_at`: waits for `gate` before the token of that index. `error_at`: raises a
    KVTransferError instead of the token of that index (in the first `fail_times` calls; None:
    in all; `names_replica`: a ReplicaFailure naming the replica, as a served replica raises).
    A moved request (its prompt plus the tokens delivered) gets the rest of `text`. Each
    call's first event names the replica "decode-<call index>". `released` lists the handoffs
    it was asked to release; with `release_gate`, a release answers once the gate opens.
    """

    def __init__(
        self,
        text: str = "orld",
        finish_reason: str | None = "length",
        *,
        release_is_idempotent: bool = False,
        gate: asyncio.Event | None = None,
        gate_at: int = 0,
        error_at: int | None = None,
        fail_times: int | None = None,
        names_replica: bool = False,
        first: str = "W",
        release_gate: asyncio.Event | None = None,
    ) -> None:
        self.text = text
        self.release_gate = release_gate
        self.first = first
        self.local: list[GenerationRequest] = []
        self.fail_times = fail_times
        self.names_replica = names_replica
        self.finish_reason = finish_reason
        self._release_is_idempotent = release_is_idempotent
        self.gate = gate
        self.gate_at = gate_at
        self.error_at = error_at
        self.requests: list[GenerationRequest] = []
        self.decoded: list[KVHandoff] = []
        self.released: list[KVHandoff] = []
        self.avoided: list[frozenset[str]] = []
        self.waiting = asyncio.Event()

    @property
    def release_is_idempotent(self) -> bool:
        return self._release_is_idempotent

    async def decode(
        self, request: GenerationRequest, handoff: KVHandoff, avoid: frozenset[str] = frozenset()
    ) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        self.avoided.append(avoid)
        self.decoded.append(handoff)
        call = len(self.requests) - 1
        fails = self.fail_times is None or call < self.fail_times
        text = self.text[_num_delivered(self.requests, request) :]
        for index, char in enumerate(text):
            if self.gate is not None and index == self.gate_at:
                self.waiting.set()
                await self.gate.wait()
            if index == self.error_at and fails:
                if self.names_replica:  # as a served replica does (ReplicaShell)
                    raise ReplicaFailure(f"decode-{call}", "EngineDeadError: the engine died")
                raise KVTransferError(f"decode of {request.request_id} lost its KV")
            last = index == len(text) - 1
            yield TokenEvent(
                (ord(char),),
                self.finish_reason if last else None,
                replica_id=f"decode-{call}" if index == 0 else "",
            )

    async def generate(
        self, request: GenerationRequest, avoid: frozenset[str] = frozenset()
    ) -> AsyncIterator[TokenEvent]:
        """The whole answer (`first` then `text`) here, as a decode replica that prefills for
        itself; the first event is the first token, naming "decode-local-<call index>"."""
        self.local.append(request)
        self.avoided.append(avoid)
        answer = (self.first + self.text)[_num_delivered(self.requests + self.local, request) :]
        for index, char in enumerate(answer):
            last = index == len(answer) - 1
            yield TokenEvent(
                (ord(char),),
                self.finish_reason if last else None,
                is_first=index == 0,
                replica_id=f"decode-local-{len(self.local) - 1}" if index == 0 else "",
            )

    async def release(self, handoff: KVHandoff) -> None:
        self.released.append(handoff)
        if self.release_gate is not None:  # asked; answers once the gate opens
            await self.release_gate.wait()


class FakeEngines:
    """The disaggregated topology over the two fake pools (`router.service.EngineStream`)."""

    def __init__(self, prefill: FakePrefill, decode: FakeDecode) -> None:
        self.prefill = prefill
        self.decode = decode

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return generate_disaggregated(self.prefill, self.decode, request)


class FakeColocated:
    """The colocated pool: streams `text` one token per event, the first flagged as the first
    token and naming the replica "engine-<call index>", the last with finish reason "length".
    `error_at`: raises a RuntimeError (the engine died) instead of the token of that index, in
    the first `fail_times` calls (None: in all). A moved request gets the rest of `text`."""

    def __init__(self, text: str = "World", *, error_at: int | None = None,
                 fail_times: int | None = None) -> None:  # fmt: skip
        self.text = text
        self.error_at = error_at
        self.fail_times = fail_times
        self.requests: list[GenerationRequest] = []
        self.avoided: list[frozenset[str]] = []

    async def generate(
        self, request: GenerationRequest, avoid: frozenset[str] = frozenset()
    ) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        self.avoided.append(avoid)
        call = len(self.requests) - 1
        fails = self.fail_times is None or call < self.fail_times
        text = self.text[_num_delivered(self.requests, request) :]
        for index, char in enumerate(text):
            if index == self.error_at and fails:
                raise RuntimeError(f"the engine under {request.request_id} died")
            last = index == len(text) - 1
            yield TokenEvent(
                (ord(char),),
                "length" if last else None,
                is_first=index == 0,
                replica_id=f"engine-{call}" if index == 0 else "",
            )
