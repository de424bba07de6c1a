"""Model resolution: built-in names (`default`, `tiny`), any local Hugging Face folder, or a
Hugging Face repo id (`org/name`, optionally `org/name@revision`).

A repo id is looked up in the Hugging Face cache first (HF_HUB_CACHE, as `huggingface-cli
download` fills it); only when it is not there, and HF_HUB_OFFLINE is not set, is it
downloaded, into that cache.

Built-in models are prepared once into the cache (PDSERVE_CACHE_DIR, default ~/.cache/pdserve)
and reused; preparation is atomic and locked, so concurrent processes never see half a folder.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from engine.smollm2 import convert_smollm2
from engine.tiny import build_tiny_model

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"

_BUILDERS: dict[str, Callable[[Path], Path]] = {
    DEFAULT_MODEL: convert_smollm2,
    TINY_MODEL: build_tiny_model,
}
_ALIASES = {
    "default": DEFAULT_MODEL,
    "smollm2": DEFAULT_MODEL,
    DEFAULT_MODEL: DEFAULT_MODEL,
    TINY_MODEL: TINY_MODEL,
}
_COMPLETE_MARKER = ".pdserve-complete"


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", "~/.cache/pdserve")).expanduser()


def builtin_names() -> list[str]:
    return sorted(_ALIASES)


def is_builtin(name: str) -> bool:
    return name in _ALIASES


def resolve_model(name: str) -> Path:
    """The local folder that serves `name`, preparing a built-in model on first use."""
    if is_builtin(name):
        return prepare_builtin(_ALIASES[name])
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if _REPO_ID.fullmatch(name) and not path.exists():
        return _from_hub(name)
    raise ValueError(
        f"unknown model {name!r}: give a built-in name ({', '.join(builtin_names())}), "
        "a local Hugging Face folder that holds a config.json, or a Hugging Face repo id"
    )


# org/name[@revision], as the Hub names repositories.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def _from_hub(name: str) -> Path:
    """The snapshot folder of a Hugging Face repo id: from the cache, else downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = name.partition("@")
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        found = snapshot_download(
            repo_id, revision=revision or None, cache_dir=cache_dir, local_files_only=True
        )
    except LocalEntryNotFoundError:
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise ValueError(
                f"model {name!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set"
            ) from None
        found = snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir)
    folder = Path(found)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model {name!r}: its snapshot {folder} holds no config.json")
    return folder


def prepare_builtin(name: str) -> Path:
    dest = cache_root() / "models" / name
    if (dest / _COMPLETE_MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / _COMPLETE_MARKER).is_file():
            return dest
        partial = dest.parent / f".{name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        _BUILDERS[name](partial)
        (partial / _COMPLETE_MARKER).write_text("ok\n")
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)
    return dest
