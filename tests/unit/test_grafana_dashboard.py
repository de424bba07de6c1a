"""deploy/grafana/pdserve.json: valid, every query names metrics by the names Ray exports, and it
covers what operators watch. tests/e2e/test_observability.py checks the names against a running
app's scrape."""

from __future__ import annotations

import pytest

from tests.grafana import exported_names, load_dashboard, metric_names, panels, queries


@pytest.mark.parametrize(
    ("query", "names"),
    [
        (
            'histogram_quantile(0.95, sum by (le, pool) (rate(ray_vllm_x_bucket{app=~"$app",'
            'pool=~"prefill|engine"}[$__rate_interval])))',
            {"ray_vllm_x_bucket"},
        ),
        ("sum(a_total) / on(app) group_left(pool) b{c='d'} * 1e3", {"a_total", "b"}),
        ("vector($ttft_slo)", set()),
        ("rate(x[5m] offset 1h) or vector(0)", {"x"}),
    ],
)
def test_metric_names_of_a_query(query: str, names: set[str]) -> None:
    assert metric_names(query) == names


def test_exported_names_reads_samples_not_comments() -> None:
    text = (
        "# HELP ray_a_total x\n# TYPE ray_a_total counter\n"
        'ray_a_total{app="p",le="1"} 2.0\nray_b 1\n'
    )
    assert exported_names(text) == {"ray_a_total", "ray_b"}


def test_every_panel_queries_metrics_as_ray_exports_them() -> None:
    dashboard = load_dashboard()
    graphs = [p for p in panels(dashboard) if p["type"] != "row"]
    assert graphs
    for panel in graphs:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        # Every graph shows at least one metric (an SLO line alone is no graph).
        assert set().union(*map(metric_names, exprs)), panel["title"]
    names = set().union(*map(metric_names, queries(dashboard)))
    assert all(name.startswith("ray_") for name in names), sorted(names)
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_the_dashboard_covers_what_operators_watch() -> None:
    names = set().union(*map(metric_names, queries(load_dashboard())))
    wanted = {
        "ray_pdserve_ttft_seconds_bucket",  # TTFT against its SLO
        "ray_pdserve_tpot_seconds_bucket",  # TPOT against its SLO
        "ray_vllm_time_to_first_token_seconds_bucket",  # per prefill replica
        "ray_vllm_inter_token_latency_seconds_bucket",  # per decode replica
        "ray_pdserve_kv_transfer_engine_seconds_bucket",  # KV transfer time
        "ray_pdserve_kv_transfer_bytes_total",  # and bytes
        "ray_pdserve_kv_load_failures_total",  # load failures
        "ray_vllm_num_requests_waiting",  # queues
        "ray_vllm_kv_cache_usage_perc",  # KV usage
        "ray_serve_deployment_replica_healthy",  # replicas
        "ray_serve_autoscaling_target_replicas",  # autoscaling decisions
    }
    assert wanted <= names, sorted(wanted - names)
