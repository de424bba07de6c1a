from __future__ import annotations

from pathlib import Path

import pytest

from engine.settings import EngineSettings


def test_cpu_defaults_translate_to_vllm() -> None:
    settings = EngineSettings(model=Path("/m/tiny"), cpu_cores=(1,))
    kwargs = settings.vllm_kwargs()
    assert kwargs["enforce_eager"] is True
    assert kwargs["block_size"] == 32
    assert kwargs["kv_cache_memory_bytes"] == 256 * 1024**2
    assert kwargs["dtype"] == "float32"
    assert kwargs["served_model_name"] == "tiny"
    assert "gpu_memory_utilization" not in kwargs
    assert settings.process_env() == {"VLLM_CPU_OMP_THREADS_BIND": "1"}


def test_gpu_keeps_vllm_defaults() -> None:
    settings = EngineSettings(
        model=Path("/m/x"), device="cuda", block_size=None, kv_cache_memory_bytes=None
    )
    kwargs = settings.vllm_kwargs()
    assert kwargs["enforce_eager"] is False
    assert "block_size" not in kwargs
    assert "kv_cache_memory_bytes" not in kwargs
    assert settings.process_env() == {}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_size": 16}, "block_size"),
        ({"block_size": None}, "block_size"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"cpu_cores": ()}, "cpu_cores"),
    ],
)
def test_bad_cpu_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineSettings(model=Path("/m"), **fields)  # type: ignore[arg-type]
