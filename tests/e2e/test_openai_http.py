"""The `openai` package against `/v1`: completions and chat completions, streaming and not,
give the same text as the monolithic engine; `/v1/models` lists the served model."""

from __future__ import annotations

import pytest

from engine.local import LocalEngine
from tests.builders import make_greedy
from tests.e2e.conftest import ServedApp

pytestmark = pytest.mark.engine

PROMPT = "The router streams the first token"
CHAT = [{"role": "user", "content": "What does the decode pool do?"}]


def _client(app: ServedApp) -> object:
    import openai

    return openai.OpenAI(
        base_url=app.openai_base, api_key=app.api_key or "unused", max_retries=0, timeout=120
    )


def _expected_text(engine: LocalEngine, ids: list[int], max_tokens: int) -> str:
    completion = engine.generate([ids], make_greedy(max_tokens, ignore_eos=True))[0]
    return str(engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True))


@pytest.mark.parametrize("key", ["nixl", "colocated"])
def test_completions(serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine, key: str) -> None:
    app = serve_apps[key]
    client = _client(app)
    want = _expected_text(tiny_engine, tiny_engine.encode(PROMPT), 12)
    with app.expect_kv_loaded(2):
        whole = client.completions.create(  # type: ignore[attr-defined]
            model="tiny", prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}
        )
        stream = client.completions.create(  # type: ignore[attr-defined]
            model="tiny", prompt=PROMPT, max_tokens=12, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = list(stream)
    assert whole.choices[0].text == want
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("key", ["nixl", "colocated"])
def test_chat_completions(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine, key: str
) -> None:
    app = serve_apps[key]
    client = _client(app)
    tokenizer = tiny_engine.tokenizer
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    want = _expected_text(
        tiny_engine, list(tokenizer(text, add_special_tokens=False)["input_ids"]), 10
    )
    with app.expect_kv_loaded(2):
        whole = client.chat.completions.create(  # type: ignore[attr-defined]
            model="tiny", messages=CHAT, max_tokens=10, extra_body={"ignore_eos": True}
        )
        stream = client.chat.completions.create(  # type: ignore[attr-defined]
            model="tiny", messages=CHAT, max_tokens=10, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = list(stream)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_and_errors(serve_apps: dict[str, ServedApp]) -> None:
    import openai

    client = _client(serve_apps["nixl"])
    assert [m.id for m in client.models.list().data] == ["tiny"]  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)  # type: ignore[attr-defined]
    assert "max_tokens" in str(info.value)
