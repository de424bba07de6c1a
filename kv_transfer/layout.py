"""The KVLayout of an engine, from its settings and model folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.messages import KVLayout
from engine.settings import EngineSettings

_CHUNK = 8 * 1024 * 1024


def weights_digest(model: Path) -> str:
    """sha256 over the model's weight files, in name order (~0.5 s for 517 MB)."""
    digest = hashlib.sha256()
    files = sorted(model.glob("*.safetensors")) or sorted(model.glob("*.bin"))
    if not files:
        raise ValueError(f"no weight files (*.safetensors, *.bin) in {model}")
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def kv_layout_for(settings: EngineSettings) -> KVLayout:
    config = json.loads((settings.model / "config.json").read_text())
    config = config.get("text_config", config)
    num_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
    return KVLayout(
        model=settings.model_name,
        weights_digest=weights_digest(settings.model),
        dtype=settings.dtype,
        block_size=settings.block_size or 16,
        num_layers=int(config["num_hidden_layers"]),
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
    )
