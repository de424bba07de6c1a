"""The Serve policies on a real Redis, called as the controller calls them: built by Serve's
`_resolve_policy_callable` from `autoscaling_config_for`'s dict, wrapped by
`_apply_autoscaling_config`, fed real `AutoscalingContext`s. No Ray cluster is started."""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Callable, Iterator
from logging.handlers import BufferingHandler
from pathlib import Path

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from autoscaling.serve_policy import (
    DecodeAutoscaler,
    PrefillAutoscaler,
    autoscaling_config_for,
)
from control.records import PoolSLO
from control.redis_server import RedisServer
from control.sync_store import SyncControlStore
from deploy.cli_ops import add_operator_commands
from deploy.local import LocalRun, free_port

# Within the 5 s TTFT SLO but not calm enough to scale down (busy 2 x 0.5 on 1 replica).
CALM_PREFILL = {
    "ttft_p95_s": 2.0,
    "queue_wait_p95_s": 0.1,
    "num_pending_tokens": 0.0,
    "num_ongoing_requests": 1.0,
    "prefill_tokens_per_s": 500.0,
    "busy_fraction": 0.5,
}
CALM_DECODE = {"tpot_p95_s": 0.05, "num_running": 8.0, "num_waiting": 0.0, "kv_cache_usage": 0.6}


def control(url: str, app: str) -> SyncControlStore:
    """The app's control plane, sync face (what `pdserve slo` / `scale` / `status` use)."""
    return SyncControlStore.connect(url, app)


class ServedPool:
    """One pool's policy as the controller holds it: target, policy state, bounds."""

    def __init__(self, pool: str, app: str, url: str | None, url_env: str | None = None) -> None:
        config = autoscaling_config_for(pool, app, url, 1, 8, 2, redis_url_env=url_env)
        self.config = AutoscalingConfig(**config)  # Serve's bounds 1..8, 2 replicas at first
        self.instance = _resolve_policy_callable(self.config.policy)
        self.policy = _apply_autoscaling_config(self.instance)
        self.deployment = DeploymentID(name=pool.capitalize(), app_name=app)
        self.target = 2
        self.state: dict[str, object] = {}
        self.now_s = 1_000_000.0

    def tick(self, replica_metrics: dict[str, float], num_replicas: int | None = None) -> int:
        """1 s later (the control-plane refresh), every replica's latest point `replica_metrics`."""
        self.now_s += 1.0
        replicas = [ReplicaID(f"r{i}", self.deployment) for i in range(num_replicas or self.target)]
        raw = {
            name: {r: [TimeStampedValue(self.now_s - 0.5, value)] for r in replicas}
            for name, value in replica_metrics.items()
        }
        ctx = AutoscalingContext(
            deployment_id=self.deployment,
            deployment_name=self.deployment.name,
            app_name=self.deployment.app_name,
            current_num_replicas=len(replicas),
            target_num_replicas=self.target,
            running_replicas=replicas,
            total_num_requests=float(len(replicas)),
            total_queued_requests=0.0,
            aggregated_metrics={},
            raw_metrics=raw,
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=dict(self.state),
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=self.now_s,
            config=self.config,
        )
        decision, self.state = self.policy(ctx)
        # What the controller does next (autoscaling_state.py apply_bounds).
        self.target = max(self.config.min_replicas, min(self.config.max_replicas, decision))
        return self.target


@pytest.fixture
def app() -> str:
    return f"as-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def policy_log() -> Iterator[Callable[..., list[str]]]:
    """The policies' log lines at `level` and above (Serve's logger may not propagate)."""
    handler = BufferingHandler(capacity=10_000)
    logger = logging.getLogger("ray.serve.pdserve")
    logger.addHandler(handler)
    yield lambda level=logging.WARNING: [
        r.getMessage() for r in handler.buffer if r.levelno >= level
    ]
    logger.removeHandler(handler)


def test_ttft_breach_scales_prefill_up_and_logs_why(url: str, app: str) -> None:
    prefill = ServedPool("prefill", app, url)
    assert isinstance(prefill.instance, PrefillAutoscaler)  # Serve built our class
    assert (prefill.config.upscale_delay_s, prefill.config.downscale_delay_s) == (0.0, 0.0)
    assert prefill.tick({**CALM_PREFILL, "ttft_p95_s": 8.0}) == 3
    (record,) = control(url, app).recent_decisions()
    assert (record.pool, record.current_replicas, record.target_replicas) == ("prefill", 2, 3)
    assert record.reason.startswith("up: TTFT P95 8.00s > SLO 5s")
    assert record.inputs["ttft_p95_s"] == 8.0 and record.inputs["slo_ttft_p95_s"] == 5.0
    # The P95 still holds samples from before the scale-up: the next ticks hold.
    assert prefill.tick({**CALM_PREFILL, "ttft_p95_s": 8.0}) == 3


def test_calm_load_keeps_the_count_and_logs_once(url: str, app: str) -> None:
    prefill = ServedPool("prefill", app, url)
    assert [prefill.tick(CALM_PREFILL) for _ in range(30)] == [2] * 30
    (record,) = control(url, app).recent_decisions()
    assert (record.target_replicas, record.reason) == (2, "hold: within SLO")


def test_a_pin_overrides_the_decision_and_obeys_bounds(url: str, app: str) -> None:
    prefill = ServedPool("prefill", app, url)
    prefill.tick(CALM_PREFILL)
    control(url, app).pin("prefill", 5)
    assert prefill.tick(CALM_PREFILL) == 5
    control(url, app).set_bounds("prefill", 1, 3)
    assert prefill.tick(CALM_PREFILL) == 3
    control(url, app).pin("prefill", 20)  # Serve's max_replicas (8) bounds it too.
    control(url, app).set_bounds("prefill", 1, 64)
    assert prefill.tick(CALM_PREFILL) == 8
    # A TTFT breach does not move a pinned pool.
    assert prefill.tick({**CALM_PREFILL, "ttft_p95_s": 30.0}) == 8
    reasons = [r.reason for r in control(url, app).recent_decisions()]
    assert reasons[:3] == [
        "pinned to 20, clamped to bounds [1, 8]",
        "pinned to 5, clamped to bounds [1, 3]",
        "pinned to 5",
    ]
    control(url, app).unpin("prefill")
    assert control(url, app).pins() == {"prefill": None, "decode": None}
    assert prefill.tick(CALM_PREFILL) == 8
    assert control(url, app).recent_decisions(1)[0].reason == "hold: within SLO"


def test_set_slo_changes_the_next_decision_without_redeploy(url: str, app: str) -> None:
    prefill = ServedPool("prefill", app, url)
    instance = prefill.instance
    assert prefill.tick(CALM_PREFILL) == 2
    assert control(url, app).set_slo(ttft_p95_s=1.0) == PoolSLO(ttft_p95_s=1.0, tpot_p95_s=0.2)
    assert prefill.tick(CALM_PREFILL) == 3
    assert prefill.instance is instance
    latest = control(url, app).recent_decisions(1)[0]
    assert latest.reason.startswith("up: TTFT P95 2.00s > SLO 1s")
    assert latest.inputs["slo_ttft_p95_s"] == 1.0


def test_decode_scales_on_tpot_breach_and_prefill_does_not(url: str, app: str) -> None:
    prefill, decode = ServedPool("prefill", app, url), ServedPool("decode", app, url)
    assert isinstance(decode.instance, DecodeAutoscaler)
    assert decode.tick({**CALM_DECODE, "tpot_p95_s": 0.5}) == 3
    assert prefill.tick(CALM_PREFILL) == 2
    (up,) = control(url, app).recent_decisions(pool="decode")
    assert up.reason.startswith("up: TPOT P95 500ms > SLO 200ms")
    assert control(url, app).recent_decisions(pool="prefill")[0].target_replicas == 2
    # A KV breach on the 2 replicas that report while the 3rd starts: replicas that have not
    # reported count as starting, and decode holds until they serve.
    assert decode.tick({**CALM_DECODE, "kv_cache_usage": 0.95}, num_replicas=2) == 3
    assert "1 replicas still starting" in control(url, app).recent_decisions(1)[0].reason


def test_the_url_can_come_from_the_controller_environment(
    url: str, app: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_TEST_REDIS_URL", url)
    prefill = ServedPool("prefill", app, None, url_env="PDSERVE_TEST_REDIS_URL")
    assert "redis://" not in str(prefill.config.policy.policy_kwargs)  # not in Serve's log
    assert prefill.tick(CALM_PREFILL) == 2
    assert control(url, app).recent_decisions()[0].reason == "hold: within SLO"


def test_redis_down_keeps_deciding_on_defaults_and_says_so(
    policy_log: Callable[..., list[str]],
) -> None:
    prefill = ServedPool("prefill", "down", f"redis://127.0.0.1:{free_port()}/0")
    assert [prefill.tick(CALM_PREFILL) for _ in range(3)] == [2, 2, 2]
    assert policy_log() == [
        "pdserve prefill autoscaler: control plane unreachable (ConnectionError); "
        "default SLO, bounds, pin"
    ]
    # The default SLO still holds the pool to its target.
    assert prefill.tick({**CALM_PREFILL, "ttft_p95_s": 8.0}) == 3
    assert "control plane unreachable" in policy_log(logging.INFO)[-1]


def test_an_unexpected_error_keeps_the_current_target(
    url: str, app: str, policy_log: Callable[..., list[str]]
) -> None:
    prefill = ServedPool("prefill", app, url)
    prefill.state = {"pdserve_history": {"events": "garbage"}}  # dropped with a warning
    assert prefill.tick(CALM_PREFILL) == 2
    prefill.instance.functions = None  # breaks every call
    assert prefill.tick({**CALM_PREFILL, "ttft_p95_s": 30.0}) == 2
    assert policy_log() == [
        "pdserve autoscaler: dropping malformed history state: "
        "history state: 'events' must be a list, got 'garbage'",
        "pdserve prefill autoscaler failed; keeping the current target",
    ]


# --- pdserve slo / scale --------------------------------------------------------------------


class Cli:
    """`pdserve` with just the operator commands, aimed at one app on the test Redis."""

    def __init__(self, url: str, app: str) -> None:
        self.url, self.app = url, app
        self.parser = argparse.ArgumentParser(prog="pdserve")
        add_operator_commands(self.parser.add_subparsers(dest="command", required=True))

    def __call__(self, *argv: str, target: bool = True) -> int:
        flags = ("--redis-url", self.url, "--app", self.app) if target else ()
        args = self.parser.parse_args([*argv, *flags])
        return int(args.func(args))


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str, app: str) -> Cli:
    monkeypatch.setenv("PDSERVE_RUN_DIR", str(tmp_path))  # no local run unless a test saves one
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    return Cli(url, app)


def test_cli_sets_the_slo_pins_and_bounds_a_policy_reads(
    cli: Cli, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("slo", "get") == 0
    assert "no SLO set" in capsys.readouterr().out
    assert cli("slo", "set", "--ttft-p95", "300ms") == 0
    assert cli("slo", "set", "--tpot-p95", "0.06s") == 0
    assert "TTFT P95 300 ms, TPOT P95 60 ms" in capsys.readouterr().out.splitlines()[-1]
    assert control(cli.url, cli.app).get_slo() == PoolSLO(0.3, 0.06)

    assert cli("scale", "decode", "--min", "2", "--max", "6") == 0
    assert cli("scale", "decode", "9") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{cli.app}: decode bounded to [2, 6]",
        f"{cli.app}: decode pinned to 9 replicas, clamped to 6 by its bounds",
    ]
    assert ServedPool("decode", cli.app, cli.url).tick(CALM_DECODE) == 6
    assert cli("scale", "decode", "auto") == 0
    assert control(cli.url, cli.app).pins()["decode"] is None
    assert "decode scales on its SLO" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("slo", "set"), "set at least one"),
        (("slo", "set", "--ttft-p95", "0ms"), "ttft_p95_s must be > 0"),
        (("scale", "prefill"), "give N, auto, or --min A --max B"),
        (("scale", "prefill", "--min", "2"), "--min and --max go together"),
        (("scale", "prefill", "--min", "4", "--max", "2"), "max_replicas must be >="),
        (("scale", "prefill", "two"), "N must be a replica count"),
    ],
)
def test_cli_errors_exit_2_with_one_line(
    cli: Cli, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: ") and message in err and err.count("\n") == 1


def test_cli_finds_the_local_run_or_exits_2(cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("slo", "get", target=False) == 2
    assert "no local run" in capsys.readouterr().err
    LocalRun("run", cli.app, 1, "127.0.0.1:1", 1, cli.url, 8000, 9000, "/tmp", "/tmp/t").save()
    assert cli("scale", "prefill", "3", target=False) == 0
    assert control(cli.url, cli.app).pins()["prefill"] == 3
    assert capsys.readouterr().out.strip() == f"{cli.app}: prefill pinned to 3 replicas"
    cli.url = f"redis://127.0.0.1:{free_port()}/0"
    assert cli("slo", "get") == 2
    assert "pdserve: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli("slo", "set", "--ttft-p95", "500")
    assert exit_info.value.code == 2
    assert "unit ms, s or m" in capsys.readouterr().err
