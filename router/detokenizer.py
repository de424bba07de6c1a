"""Incremental detokenization with stop strings: token ids in, text deltas out.

Each token is decoded once, with `tokenizers`' DecodeStream (what vLLM's own detokenizer uses):
it keeps the few ids a character or a word boundary still depends on and returns the new text,
or nothing while a multi-byte character is cut in half. Re-decoding the whole output on every
token cost 761 ms of router CPU for a 2,000-token answer. A tokenizer without a `tokenizers`
backend (a slow, pure-Python one) falls back to that whole re-decode.

A stop string ends the request with finish reason "stop" and is not returned, as in OpenAI's
API; text that may be the start of a stop string is held back until it cannot be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._text = ""  # everything decoded so far (the stream's own text, before any stop)
        self._num_sent_chars = 0
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_ids: Sequence[int], finish_reason: str | None) -> tuple[str, str | None]:
        """The new text for `token_ids`, and the finish reason (a stop string sets "stop")."""
        num_checked = len(self._text)
        self._ids.extend(token_ids)
        if self._stream is not None:
            pieces = [self._stream.step(self._backend, int(t)) for t in token_ids]
            self._text += "".join(p for p in pieces if p)
            if finish_reason is not None:
                # The stream holds back bytes of a character not complete yet; at the end they
                # are what a whole decode makes of them (U+FFFD), as the engine's text has.
                whole = str(self._tokenizer.decode(self._ids, skip_special_tokens=True))
                if whole.startswith(self._text):
                    self._text = whole
            text = self._text
        else:
            text = self._text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
            num_checked = min(num_checked, self._num_sent_chars)
        if self._stop:
            start = max(0, num_checked - self._longest_stop)
            hits = [i for s in self._stop if (i := text.find(s, start)) >= 0]
            if hits:
                text, finish_reason = text[: min(hits)], "stop"
        if finish_reason is None:
            text = text.rstrip(_INCOMPLETE)
            # Hold back a possible stop-string prefix at the end so it is never half-sent.
            held = _longest_stop_prefix(text, self._stop)
            text = text[: len(text) - held]
        delta = text[self._num_sent_chars :]
        self._num_sent_chars = max(self._num_sent_chars, len(text))
        return delta, finish_reason

    @property
    def text(self) -> str:
        return str(self._tokenizer.decode(self._ids, skip_special_tokens=True))


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins some stop string (but is not all of
    it). Only the places in the tail where a stop string's first character occurs are tried,
    longest first, so the cost follows those few places, not the stop strings' lengths."""
    best = 0
    for stop in stops:
        start = len(text) - min(len(stop) - 1, len(text))
        at = text.find(stop[0], start)
        while at >= 0 and len(text) - at > best:
            if stop.startswith(text[at:]):
                best = len(text) - at
                break
            at = text.find(stop[0], at + 1)
    return best
