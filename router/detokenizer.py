"""Incremental detokenization with stop strings: token ids in, text deltas out.

The whole text is decoded again each step (outputs are short next to the prompt) and the delta
is what is new; a trailing U+FFFD (a multi-byte character cut in half) is held back until the
next token completes it. A stop string ends the request with finish reason "stop" and is not
returned, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._num_sent_chars = 0

    def push(self, token_ids: Sequence[int], finish_reason: str | None) -> tuple[str, str | None]:
        """The new text for `token_ids`, and the finish reason (a stop string sets "stop")."""
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if self._stop:
            start = max(0, self._num_sent_chars - max(len(s) for s in self._stop))
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
