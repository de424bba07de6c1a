"""`pdserve bench relay`: the CPU of a process tree from /proc, the report's arithmetic, and the
bare gRPC floor itself (a real server process and the real client, a few streams)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bench.procfs import descendants
from bench.relay import StreamRun, TreeCPU, add_arguments, render, run_floor


def test_tree_cpu_counts_a_child_that_burns_cpu() -> None:
    burn = (
        "import time\ninput()\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", burn + "print(flush=True)\ntime.sleep(30)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.pid in descendants([os.getpid()])
        cpu = TreeCPU([os.getpid()])
        cpu.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        child.stdout.readline()  # burnt
        spent = cpu.stop()
    finally:
        child.kill()
        child.wait()
    assert spent >= 0.45  # the child's 0.5 s, and this process's bit


def test_rates_and_costs_per_token_and_request() -> None:
    run = StreamRun("pdserve", 4, 8, 100, 200, 2.0, 0.01, 0.02, 0.001, 0.002, server_cpu_s=0.5)
    assert run.messages_per_s == 50
    assert run.tokens_per_s == 100
    assert run.cpu_us_per_token == 2500
    assert run.cpu_ms_per_request == 62.5
    floor = StreamRun("grpc-floor", 4, 8, 1000, 1000, 1.0, 0.0, 0.0, 0.0, 0.0)
    table = render([floor, run])
    assert "| pdserve | 4 | 50 | 100 | 0.100 |" in table  # tokens/s over the floor's msgs/s
    assert "2500 us" in table


def test_the_floor_moves_every_message() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # Enough messages that the server's CPU reaches /proc's 10 ms ticks (128 did not, at times).
    args = parser.parse_args(["--streams", "8", "--tokens", "256"])
    args.requests = 32
    floor = run_floor(args)
    assert floor.num_messages == 32 * 256
    assert floor.num_tokens == 32 * 256
    assert floor.server_cpu_s is not None and floor.server_cpu_s > 0
