"""What a consumer engine's loads come to (engine/stats.py): a load that left more than the
prompt's last position to compute, or that the engine refused, failed."""

from __future__ import annotations

from engine.stats import EngineStatsRecorder, KVLoadCounts


def test_a_load_fails_when_the_engine_computed_the_prompt_or_refused_it() -> None:
    stats = EngineStatsRecorder()
    # 100 prompt tokens: vLLM computes the last position itself, so 99 cached is a whole load.
    assert stats.record_kv_load(100, 99, failed=False) is False
    assert stats.record_kv_load(100, 64, failed=False) is True  # 35 recomputed
    assert stats.record_kv_load(100, 99, failed=True) is True  # policy "fail" refused it
    assert stats.kv_loads == KVLoadCounts(num_loads=3, num_failures=2, num_recomputed_tokens=35)
