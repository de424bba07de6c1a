"""vLLM's own engine metrics (`vllm:*`) exported through Ray's metrics agent, labelled with the
app and pool of the replica that runs the engine.

vLLM ships the exporter: `RayPrometheusStatLogger` (vllm/v1/metrics/ray_wrappers.py) builds
PrometheusStatLogger's metrics on `ray.util.metrics`, labelled `model_name` and `engine` (vLLM's)
and `ReplicaId` (the Serve replica's unique id). It cannot take more labels, so the logger here
adds fixed ones as default tags of every metric it creates, connector metrics (NIXL's) included.

Ray exports `vllm:x` as `ray_vllm_x` (':' becomes '_', then Ray's `ray_` prefix; counters gain
`_total`, histograms `_bucket` / `_sum` / `_count`). Only Ray needs importing, and only here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def ray_stat_logger(
    labels: Mapping[str, str], on_created: Callable[[Any], None] = lambda logger: None
) -> type[Any]:
    """A vLLM aggregate stat logger class (`AsyncLLM(stat_loggers=[...])`) exporting vLLM's
    metrics through Ray with `labels` on every series; `on_created` receives the instance vLLM
    builds (to call its `refresh_gauges`). Given it, vLLM starts no prometheus_client logger
    of its own (nothing would export that one here)."""
    from vllm.v1.metrics import ray_wrappers as vllm_ray

    fixed = {str(k): str(v) for k, v in labels.items()}
    gauge = _labelled(vllm_ray.RayGaugeWrapper, fixed)
    counter = _labelled(vllm_ray.RayCounterWrapper, fixed)
    histogram = _labelled(vllm_ray.RayHistogramWrapper, fixed)

    class SpecDecodingProm(vllm_ray.RaySpecDecodingProm):
        _counter_cls = counter

    class KVConnectorProm(vllm_ray.RayKVConnectorProm):
        _gauge_cls = gauge
        _counter_cls = counter
        _histogram_cls = histogram

    class PerfMetricsProm(vllm_ray.RayPerfMetricsProm):
        _counter_cls = counter

    class LabelledRayStatLogger(vllm_ray.RayPrometheusStatLogger):
        _gauge_cls = gauge
        _counter_cls = counter
        _histogram_cls = histogram
        _spec_decoding_cls = SpecDecodingProm
        _kv_connector_cls = KVConnectorProm
        _perf_metrics_cls = PerfMetricsProm

        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            super().__init__(vllm_config, engine_indexes)
            self._last_scheduler_stats: dict[int, Any] = {}
            on_created(self)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            super().record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
            if scheduler_stats is not None:
                self._last_scheduler_stats[engine_idx] = scheduler_stats

        def refresh_gauges(self) -> None:
            """Set the queue and KV-usage gauges again from each engine's last step. Ray's
            agent drops a gauge nobody set for two report intervals, and vLLM sets these only
            when its engine steps: an idle engine's would vanish from the scrape."""
            for idx, stats in list(self._last_scheduler_stats.items()):
                self.gauge_scheduler_running[idx].set(stats.num_running_reqs)
                waiting = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
                self.gauge_scheduler_waiting[idx].set(waiting)
                self.gauge_kv_cache_usage[idx].set(stats.kv_cache_usage)

    return LabelledRayStatLogger


def _labelled(wrapper: type[Any], fixed: dict[str, str]) -> type[Any]:
    """`wrapper` (one of vLLM's Ray metric wrappers) with the `fixed` tags on every series."""

    class Labelled(wrapper):
        @staticmethod
        def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
            return (*wrapper._get_tag_keys(labelnames), *fixed)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.metric.set_default_tags(fixed)

        def _build_tags(self, *labels: Any, **named: Any) -> dict[str, str]:
            # vLLM counts positional label values against every tag key but its ReplicaId, so
            # the fixed keys would fail that count: name the values instead (vLLM's label
            # names come first among the tag keys, in order).
            named.update(zip(self.metric._tag_keys, labels, strict=False))
            tags: dict[str, str] = super()._build_tags(**named)
            return tags

    Labelled.__name__ = Labelled.__qualname__ = f"Labelled{wrapper.__name__}"
    return Labelled
