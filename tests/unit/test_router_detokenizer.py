"""Incremental detokenization: deltas add up to the whole text; stop strings end the request
and are never sent, not even in part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.detokenizer import Detokenizer, _longest_stop_prefix


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from engine.prompts import load_tokenizer

    return load_tokenizer(str(tiny_model))


TEXT = "The decode pool streams tokens. Then it stops here, and more text follows."


def _stream(tokenizer: Any, stop: tuple[str, ...] = ()) -> tuple[str, str | None, int]:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tokenizer, stop)
    sent, finish, steps = "", None, 0
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        delta, finish = detok.push([token], "length" if last else None)
        sent += delta
        steps += 1
        if finish is not None:
            break
    return sent, finish, steps


def test_deltas_join_to_the_full_text(tokenizer: Any) -> None:
    sent, finish, _ = _stream(tokenizer)
    assert sent == tokenizer.decode(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    assert finish == "length"


def test_stop_string_ends_the_stream_and_is_not_sent(tokenizer: Any) -> None:
    sent, finish, steps = _stream(tokenizer, stop=("stops here",))
    assert finish == "stop"
    assert sent == TEXT[: TEXT.index("stops here")]
    assert steps < len(tokenizer(TEXT, add_special_tokens=False)["input_ids"])


def test_first_of_several_stop_strings_wins(tokenizer: Any) -> None:
    sent, finish, _ = _stream(tokenizer, stop=("more text", "Then"))
    assert finish == "stop"
    assert sent == TEXT[: TEXT.index("Then")]


def test_a_partial_stop_string_is_held_back(tokenizer: Any) -> None:
    detok = Detokenizer(tokenizer, ("stops here",))
    ids = tokenizer("it st", add_special_tokens=False)["input_ids"]
    delta, finish = detok.push(ids, None)
    assert finish is None
    assert not delta.endswith("st")  # might still become "stops here"


@settings(max_examples=2000, deadline=None)
@given(
    text=st.text(alphabet="ab\u00e9", max_size=30),
    stops=st.lists(st.text(alphabet="ab\u00e9", min_size=1, max_size=8), min_size=1, max_size=4),
)
def test_held_back_prefix_is_the_longest_end_that_begins_a_stop(
    text: str, stops: list[str]
) -> None:
    # The definition, checked by brute force: the longest proper prefix of a stop string that
    # the text ends with.
    want = max(
        (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )
    assert _longest_stop_prefix(text, stops) == want


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_ids_stream_to_exactly_the_whole_decode(tokenizer: Any, data: st.DataObject) -> None:
    """Random ids (byte tokens that leave a character unfinished included, as a random-weight
    model emits): the deltas join to what one decode of all the ids gives, at the end too."""
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=40))
    detok = Detokenizer(tokenizer)
    sent = "".join(
        detok.push([t], "length" if i == len(ids) - 1 else None)[0] for i, t in enumerate(ids)
    )
    assert sent == tokenizer.decode(ids, skip_special_tokens=True)
