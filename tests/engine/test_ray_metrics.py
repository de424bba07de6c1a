"""vLLM's Ray stat logger with pdserve's labels (engine/ray_metrics.py): every metric it
creates, the NIXL connector's included, carries the app and pool beside vLLM's own labels, and
what it records reaches Ray's metric with all of them. No engine starts: vLLM's config only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.stats import EngineStatsRecorder, engine_stat_loggers
from tests.builders import make_settings

pytestmark = pytest.mark.engine

LABELS = {"app": "pd-test", "pool": "decode"}


@pytest.fixture(scope="module")
def vllm_config(tiny_model: Path) -> Any:
    from vllm.config import KVTransferConfig

    nixl = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    return make_settings(tiny_model).async_engine_args(nixl).create_engine_config()


def test_every_vllm_metric_carries_app_and_pool(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.util import metrics as ray_metrics

    created: list[Any] = []
    recorded: list[tuple[str, dict[str, str]]] = []
    original_init, original_record = ray_metrics.Metric.__init__, ray_metrics.Metric._record

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        created.append(self)

    def record(self: Any, value: float, tags: dict[str, str] | None = None) -> None:
        recorded.append((self._name, self._get_final_tags(tags)))
        original_record(self, value, tags)

    monkeypatch.setattr(ray_metrics.Metric, "__init__", init)
    monkeypatch.setattr(ray_metrics.Metric, "_record", record)

    recorder = EngineStatsRecorder()
    recorder.export_labels = LABELS
    loggers = engine_stat_loggers(recorder)
    assert loggers is not None and len(loggers) == 2
    logger = loggers[1](vllm_config=vllm_config, engine_indexes=[0])

    names = {metric._name for metric in created}
    assert {"vllm_num_requests_running", "vllm_kv_cache_usage_perc"} <= names
    assert "vllm_time_to_first_token_seconds" in names
    assert "vllm_nixl_xfer_time_seconds" in names, sorted(names)
    unlabelled = [m._name for m in created if not LABELS.items() <= m._default_tags.items()]
    assert not unlabelled

    from vllm.v1.metrics.stats import SchedulerStats

    logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1), None, engine_idx=0)
    running = [tags for name, tags in recorded if name == "vllm_num_requests_running"]
    assert running, recorded
    assert running[0] == {
        **LABELS,
        "model_name": vllm_config.model_config.served_model_name,
        "engine": "0",
        "ReplicaId": "",  # not in a Serve replica here
    }

    # The replica's stats tick sets the gauges again from the last step (an idle engine's
    # gauges would otherwise age out of Ray's agent).
    assert recorder.exporters == [logger]
    recorded.clear()
    recorder.refresh_exported_gauges()
    refreshed = {name for name, _ in recorded}
    assert {"vllm_num_requests_running", "vllm_num_requests_waiting"} <= refreshed
    assert "vllm_kv_cache_usage_perc" in refreshed


def test_no_export_labels_no_ray_logger() -> None:
    assert engine_stat_loggers(None) is None
    loggers = engine_stat_loggers(EngineStatsRecorder())
    assert loggers is not None and len(loggers) == 1
