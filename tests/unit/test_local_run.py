"""Local-mode process bookkeeping: the run marker finds exactly our processes; stop_pid stops
one by PID, stop_pids several at once; percentiles for `pdserve status`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from deploy.local import (
    RUN_MARKER,
    marked_pids,
    new_run_id,
    pid_is_alive,
    port_is_free,
    stop_pid,
    stop_pids,
)
from deploy.status import format_latencies
from engine.autoscaling_stats import percentile_of as percentile


def test_marker_finds_children_and_stop_pid_stops_them() -> None:
    run_id = new_run_id()
    env = {**os.environ, RUN_MARKER: run_id}
    # A parent whose child inherits the marker, as Ray's workers and vLLM's engines do.
    child = "import time; time.sleep(60)"
    script = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    try:
        for _ in range(50):
            if len(marked_pids(run_id)) == 2:
                break
            time.sleep(0.1)
        found = marked_pids(run_id)
        assert parent.pid in found and len(found) == 2
        assert marked_pids(new_run_id()) == []
        for pid in found:
            stop_pid(pid, timeout_s=5)
        parent.wait(timeout=5)
        assert marked_pids(run_id) == []
    finally:
        if parent.poll() is None:
            parent.kill()


def test_port_is_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])


def test_a_port_with_connections_in_time_wait_is_free() -> None:
    # `up` right after `down` of a run that served HTTP: the server closed its connections
    # first, so they sit in TIME-WAIT on the server's port for a minute. A server would bind
    # (SO_REUSEADDR); the probe must agree.
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC do
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server's side closes first: its end of the connection enters TIME-WAIT
    client.recv(1)
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError, match="in use"):
        plain.bind(("127.0.0.1", port))  # the old probe's bind: refused while TIME-WAIT lasts
    assert port_is_free(port)


@pytest.mark.parametrize("q", [0, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [0.3, 0.01, 2.5, 0.7, 0.7, 1.1, 0.05]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_format_latencies_marks_empty_metrics() -> None:
    lines = format_latencies({"ttft": [0.1, 0.2, 0.3]})
    ttft = next(line for line in lines if line.strip().startswith("ttft"))
    assert ttft.split()[1] == "3" and "200ms" in ttft
    tpot = next(line for line in lines if line.strip().startswith("tpot"))
    assert tpot.split()[1:] == ["0", "-", "-", "-"]


def test_status_warns_of_failed_kv_loads_and_dead_engines() -> None:
    from dataclasses import replace

    from control.records import RoleTable
    from deploy.status import format_replicas, health_warnings, kv_load_warnings
    from engine.messages import ReplicaLoad

    def load(replica: str, loads: int, failures: int, tokens: int) -> ReplicaLoad:
        return ReplicaLoad(replica, "decode", 0, 0, 0, 0.0, 10, 10, 1.0, loads, failures, tokens)

    assert kv_load_warnings([load("decode-a", 5, 0, 0)]) == []
    assert health_warnings([load("decode-a", 5, 0, 0)]) == []
    dead = replace(load("decode-b", 0, 0, 0), is_healthy=False)
    assert health_warnings([load("decode-a", 5, 0, 0), dead]) == [
        "WARNING: decode-b's engine died; the routers skip it until Serve replaces it"
    ]
    table = format_replicas([load("decode-a", 5, 0, 0), dead])
    assert [line.split()[1:3] for line in table[1:]] == [["decode", "ok"], ["decode", "DEAD"]]
    # A flipped replica shows the pool whose calls it takes.
    flipped = format_replicas([dead], RoleTable(version=1, flipped={"decode-b": "prefill"}))
    assert flipped[1].split()[:2] == ["decode-b", "prefill"]
    warning = kv_load_warnings([load("decode-a", 5, 1, 99), load("decode-b", 3, 2, 40)])
    assert warning == [
        "WARNING: 3 of 8 KV loads failed; decode recomputed 139 prompt tokens (see "
        "pdserve_kv_load_failures_total and the decode replicas' logs)"
    ]


def test_the_prefill_split_is_the_share_computed_on_decode_replicas() -> None:
    from deploy.status import format_split, prefill_split

    assert prefill_split({}) is None
    assert format_split({}) == ["  (no disaggregated request yet)"]
    samples = {"local_prefill": [1.0, 0.0, 1.0, 1.0]}
    assert prefill_split(samples) == (4, 0.75)
    assert format_split(samples) == ["  last 4 requests: 75% on their decode replica, 25% remote"]


def test_stop_pids_terms_all_then_kills_the_ones_still_running() -> None:
    """One process that exits on SIGTERM (saying so) and one that ignores it: the first ends on
    the SIGTERM, the second is SIGKILLed once the shared wait is over."""
    polite = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys, time\n"
         "def bye(*_): print('term', flush=True); sys.exit(0)\n"
         "signal.signal(signal.SIGTERM, bye); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    stubborn = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for proc in (polite, stubborn):
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        stop_pids([polite.pid, stubborn.pid], timeout_s=1)
        assert polite.stdout is not None and polite.stdout.readline() == "term\n"
        assert not pid_is_alive(polite.pid)
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
    finally:
        for proc in (polite, stubborn):
            if proc.poll() is None:
                proc.kill()
