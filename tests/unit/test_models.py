from __future__ import annotations

from pathlib import Path

import pytest

from engine.models import builtin_names, resolve_model
from engine.prompts import encode_prompt, load_tokenizer


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(str(tmp_path))


def test_local_folder_is_served_as_is(tiny_model: Path) -> None:
    assert resolve_model(str(tiny_model)) == tiny_model.resolve()


def test_builtin_names() -> None:
    assert {"default", "tiny", "smollm2-135m-instruct"} <= set(builtin_names())


def test_tiny_model_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    from engine.tiny import build_tiny_model

    again = build_tiny_model(tmp_path / "tiny")
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_prompt_encoding(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(tokenizer, "")
    ids = encode_prompt(tokenizer, "hello world")
    assert tokenizer.decode(ids) == "hello world"
    chat = encode_prompt(tokenizer, "hello world", chat=True)
    assert chat[0] == tokenizer.bos_token_id


def _hub_cache(root: Path, repo_id: str, source: Path, revision: str = "main") -> Path:
    """`source`'s files laid out as the Hugging Face cache holds a downloaded repo:
    models--org--name/{refs/<revision>, snapshots/<commit>/...}."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / revision).write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    return snapshot


def test_a_repo_id_is_served_from_the_hugging_face_cache_offline(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _hub_cache(tmp_path / "hub", "acme/tiny-chat", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("acme/tiny-chat") == snapshot
    assert resolve_model("acme/tiny-chat@main") == snapshot
    tokenizer = load_tokenizer(str(resolve_model("acme/tiny-chat")))
    assert encode_prompt(tokenizer, "hello") == encode_prompt(
        load_tokenizer(str(tiny_model)), "hello"
    )
    with pytest.raises(ValueError, match="not in the Hugging Face cache and HF_HUB_OFFLINE"):
        resolve_model("acme/not-downloaded")
