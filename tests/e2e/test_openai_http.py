"""The `openai` package against `/v1`: completions and chat completions, streaming and not,
give the same text as the monolithic engine; `/v1/models` lists the served model; vLLM's own
benchmark client and sampling fields work as against vLLM."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.local import LocalEngine
from engine.params import GenerationParams, StructuredOutput
from tests.builders import make_greedy
from tests.e2e.conftest import ServedApp
from tests.e2e.metrics import settled_metric

pytestmark = pytest.mark.engine

PROMPT = "The router streams the first token"
CHAT = [{"role": "user", "content": "What does the decode pool do?"}]
# Greedy comparisons send temperature 0: like vLLM's server, the OpenAI surface samples at the
# model's generation_config defaults (else temperature 1) when a request names none.
IGNORE_EOS = {"ignore_eos": True}


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
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
        )
        stream = client.completions.create(  # type: ignore[attr-defined]
            model="tiny",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body=IGNORE_EOS,
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
            model="tiny", messages=CHAT, max_tokens=10, temperature=0, extra_body=IGNORE_EOS
        )
        stream = client.chat.completions.create(  # type: ignore[attr-defined]
            model="tiny",
            messages=CHAT,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body=IGNORE_EOS,
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


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_runs_without_failures(
    serve_apps: dict[str, ServedApp], tiny_model: Path, tmp_path: Path, backend: str, endpoint: str
) -> None:
    """vLLM's own client, as the README runs it: every request succeeds and its tokens count."""
    app = serve_apps["nixl"]
    command = [sys.executable, "-m", "bench.vllm_bench", "serve", "--backend", backend]
    command += ["--base-url", f"http://127.0.0.1:{app.http_port}/{app.name}"]
    command += ["--endpoint", endpoint, "--model", "tiny", "--tokenizer", str(tiny_model)]
    command += ["--dataset-name", "random", "--random-input-len", "24"]
    command += ["--random-output-len", "6", "--num-prompts", "6", "--ignore-eos"]
    command += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    env = {**os.environ, "OPENAI_API_KEY": app.api_key or ""}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"]) == (6, 0), result.get("errors")
    assert result["total_output_tokens"] == 6 * 6


def test_vllm_sampling_fields_are_honoured_as_the_engine_does(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine
) -> None:
    """Penalties, min_p and a negative seed reach both pools: the disaggregated answer equals
    the monolithic engine's with the same parameters."""
    client = _client(serve_apps["nixl"])
    extra = {"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05, "top_k": -1}
    params = GenerationParams(
        max_tokens=12,
        temperature=0.8,
        seed=-7,
        ignore_eos=True,
        repetition_penalty=1.3,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    want = tiny_engine.generate([tiny_engine.encode(PROMPT)], params)[0]
    got = client.completions.create(  # type: ignore[attr-defined]
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.8,
        seed=-7,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        user="someone",
        extra_body=extra,
    )
    assert got.choices[0].text == tiny_engine.tokenizer.decode(
        want.token_ids, skip_special_tokens=True
    )
    # A stop token id ends the answer at that token, as in vLLM.
    greedy = tiny_engine.generate([tiny_engine.encode(PROMPT)], make_greedy(12, ignore_eos=True))
    stop_id = greedy[0].token_ids[5]
    stopped = client.completions.create(  # type: ignore[attr-defined]
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    cut = greedy[0].token_ids[: greedy[0].token_ids.index(stop_id) + 1]
    assert stopped.usage.completion_tokens == len(cut)
    assert stopped.choices[0].finish_reason == "stop"


def test_request_ids_and_streamed_usage_as_vllm_sends_them(
    serve_apps: dict[str, ServedApp],
) -> None:
    import httpx

    app = serve_apps["nixl"]
    headers = {**app.http_headers, "X-Request-Id": "trace-42"}
    body = {"model": "tiny", "messages": CHAT, "max_completion_tokens": 4, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "n": 1, "logprobs": False}
    with httpx.stream(
        "POST", f"{app.openai_base}/chat/completions", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["x-request-id"] == "trace-42"
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-trace-42"}
    *tokens, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert sum(1 for c in tokens if c["choices"][0]["delta"].get("content")) >= 1
    refused = httpx.post(
        f"{app.openai_base}/completions",
        json={"model": "tiny", "prompt": "hi", "echo": True},
        headers=app.http_headers,
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_n_choices_each_match_the_engine_with_its_seed(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine
) -> None:
    """n=2 through the disaggregated app: choice i is the monolithic engine's answer sampled
    with seed + i (as vLLM seeds its choices); usage counts the prompt once."""
    client = _client(serve_apps["nixl"])
    prompt_ids = tiny_engine.encode(PROMPT)
    wants = [
        tiny_engine.tokenizer.decode(
            tiny_engine.generate(
                [prompt_ids],
                GenerationParams(max_tokens=8, temperature=1.0, seed=40 + i, ignore_eos=True),
            )[0].token_ids,
            skip_special_tokens=True,
        )
        for i in range(2)
    ]
    asked: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8}
    asked |= {"temperature": 1.0, "seed": 40, "n": 2, "extra_body": IGNORE_EOS}
    whole = client.completions.create(**asked)  # type: ignore[attr-defined]
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == wants
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == 16
    stream = client.completions.create(  # type: ignore[attr-defined]
        **asked, stream=True, stream_options={"include_usage": True}
    )
    texts = ["", ""]
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == wants
    assert usage is not None and usage.completion_tokens == 16


@pytest.mark.parametrize("key", ["nixl", "colocated"])
def test_logprobs_are_the_engines_the_first_from_prefill(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine, key: str
) -> None:
    """Completions with logprobs=2 and chat with top_logprobs=2: each token's log-probability
    and its two most likely alternatives equal the monolithic engine's (the first token's come
    from the prefill engine, the rest from decode)."""
    client = _client(serve_apps[key])
    want = tiny_engine.generate(
        [tiny_engine.encode(PROMPT)],
        GenerationParams(max_tokens=6, ignore_eos=True, logprobs=2),
    )[0]
    assert want.logprobs is not None
    text_of = {t: tiny_engine.tokenizer.decode([t]) for e in want.logprobs for t, _ in e}
    got = client.completions.create(  # type: ignore[attr-defined]
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body=IGNORE_EOS
    )
    lp = got.choices[0].logprobs
    assert lp.tokens == [text_of[e[0][0]] for e in want.logprobs]
    assert lp.token_logprobs == pytest.approx([e[0][1] for e in want.logprobs], abs=1e-3)
    for top, entry in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert list(top) == [text_of[t] for t, _ in entry[1:]]
        assert list(top.values()) == pytest.approx([v for _, v in entry[1:]], abs=1e-3)
    chat = client.chat.completions.create(  # type: ignore[attr-defined]
        model="tiny",
        messages=CHAT,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [
        e
        for c in chat
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob <= 0.0 and e.bytes == list(e.token.encode()) for e in entries)


# A constraint the tiny model's own greedy answer does not meet, and a JSON one it cannot pad
# with whitespace (an enum of strings).
DIGITS = "[0-9]{3}-[a-z]{2,6}"
COLOURS = {"type": "string", "enum": ["red", "green", "blue"]}


@pytest.mark.parametrize("key", ["nixl", "ray", "colocated"])
def test_structured_output_constrains_the_answer_as_the_engine_does(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine, key: str
) -> None:
    """`structured_outputs` (vLLM's) and `response_format` (OpenAI's) reach the engines: the
    answer is the monolithic engine's under the same constraint, and meets it (prefill samples
    the first token under it, decode re-samples that token under it and goes on)."""
    app = serve_apps[key]
    client = _client(app)
    ids = tiny_engine.encode(PROMPT)

    def engine_text(structured: StructuredOutput) -> str:
        params = GenerationParams(max_tokens=16, structured=structured)
        out = tiny_engine.generate([ids], params)[0]
        return str(tiny_engine.tokenizer.decode(out.token_ids, skip_special_tokens=True))

    unconstrained = _expected_text(tiny_engine, ids, 16)
    assert re.fullmatch(DIGITS, unconstrained) is None
    with app.expect_kv_loaded(2):
        regex = client.completions.create(  # type: ignore[attr-defined]
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"structured_outputs": {"regex": DIGITS}},
        )
        schema = {"name": "colour", "schema": COLOURS}
        coloured = client.completions.create(  # type: ignore[attr-defined]
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"response_format": {"type": "json_schema", "json_schema": schema}},
        )
    assert regex.choices[0].text == engine_text(StructuredOutput("regex", DIGITS))
    assert re.fullmatch(DIGITS, regex.choices[0].text), regex.choices[0].text
    assert regex.choices[0].finish_reason == "stop"
    assert coloured.choices[0].text == engine_text(StructuredOutput("json", json.dumps(COLOURS)))
    assert json.loads(coloured.choices[0].text) in COLOURS["enum"]
    # A constraint vLLM cannot compile is the request's fault: a 400 counted once as invalid,
    # and the app serves on.
    import openai

    invalid_before = settled_metric("pdserve_requests_total", app=app.name, outcome="invalid")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(  # type: ignore[attr-defined]
            model="tiny",
            prompt=PROMPT,
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "[0-9"}},
        )
    assert "structured_outputs.regex: refused by the engine" in str(refused.value)
    invalid = settled_metric("pdserve_requests_total", app=app.name, outcome="invalid")
    assert invalid == invalid_before + 1
    again = client.completions.create(  # type: ignore[attr-defined]
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=IGNORE_EOS
    )
    assert again.choices[0].text == unconstrained
