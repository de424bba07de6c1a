"""Model resolution: built-in names (`default`, `tiny`) or any local Hugging Face folder.

Built-in models are prepared once into the cache (PDSERVE_CACHE_DIR, default ~/.cache/pdserve)
and reused; preparation is atomic and locked, so concurrent processes never see half a folder.
"""

from __future__ import annotations

import fcntl
import os
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
    raise ValueError(
        f"unknown model {name!r}: give a built-in name ({', '.join(builtin_names())}) "
        "or a local Hugging Face folder that holds a config.json"
    )


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
