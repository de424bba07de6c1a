"""The OpenAI routes' body reader (router/openai_api.read_json) on JSON that used to give 500s:
over-long bodies (413: kept to the limit, drained up to 8x it), deep nesting, huge integers,
bad UTF-8."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.requests import Request

from router.openai_api import BodyTooLarge, read_json
from router.validation import InvalidRequest


class Upload:
    """An ASGI request body sent in 256-byte messages; counts the messages the reader took."""

    def __init__(self, body: bytes, declare_length: bool = False) -> None:
        chunks = [body[i : i + 256] for i in range(0, len(body), 256)] or [b""]
        self._messages = [
            {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
            for i, chunk in enumerate(chunks)
        ]
        self.num_received = 0
        headers = [(b"content-length", str(len(body)).encode())] if declare_length else []
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        self.request = Request(scope, self._receive)

    async def _receive(self) -> dict[str, Any]:
        self.num_received += 1
        return self._messages.pop(0)


async def _read(body: bytes, max_bytes: int = 4096) -> Any:
    return await read_json(Upload(body).request, max_bytes)


async def test_a_valid_body_is_read() -> None:
    assert await _read(json.dumps({"prompt": "hi"}).encode()) == {"prompt": "hi"}


async def test_an_over_long_body_is_413_kept_to_the_limit_and_drained_within_bounds() -> None:
    """The reader keeps no more than the limit; it reads the rest of a body up to 8x the limit
    and throws it away, so the client gets to read its 413 (the CI run where it did not: the
    client saw "connection reset by peer" while still sending)."""
    near = b'{"prompt": "' + b"x" * 20_000 + b'"}'  # 5x the limit: drained to the end
    for declare_length in (False, True):
        upload = Upload(near, declare_length)
        with pytest.raises(BodyTooLarge, match="at most 4096"):
            await read_json(upload.request, 4096)
        assert upload.num_received == len(near) // 256 + 1  # every message read
    far = b'{"prompt": "' + b"x" * 100_000 + b'"}'  # 24x the limit
    upload = Upload(far)
    with pytest.raises(BodyTooLarge, match="is over 4096 bytes"):
        await read_json(upload.request, 4096)
    assert upload.num_received == 8 * 4096 // 256 + 1  # of 392 messages: the drain stops at 8x
    declared = Upload(far, declare_length=True)
    with pytest.raises(BodyTooLarge, match=f"is {len(far)} bytes"):
        await read_json(declared.request, 4096)
    assert declared.num_received == 0  # declared past 8x: refused without reading


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "hi", ',  # truncated
        b'{"max_tokens": ' + b"9" * 5000 + b"}",  # past Python's int digit limit
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser's stack
        b'{"prompt": "\xff\xfe"}',  # not UTF-8
    ],
    ids=["truncated", "5000-digit-int", "deep-nesting", "bad-utf8"],
)
async def test_json_the_parser_refuses_is_a_400_naming_the_body(body: bytes) -> None:
    with pytest.raises(InvalidRequest) as raised:
        await _read(body, max_bytes=1_000_000)
    assert raised.value.field == "body"
    assert len(str(raised.value)) < 300


async def test_a_body_that_is_not_an_object_is_a_400() -> None:
    with pytest.raises(InvalidRequest, match="must be a JSON object, got list"):
        await _read(b'["hi"]')
