from __future__ import annotations

import pytest

from engine.params import GenerationParams


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"min_tokens": 65}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_values_name_the_field(fields: dict[str, object], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        GenerationParams(**fields)  # type: ignore[arg-type]


def test_greedy_is_temperature_zero() -> None:
    assert GenerationParams().is_greedy
    assert not GenerationParams(temperature=0.7, seed=3).is_greedy
