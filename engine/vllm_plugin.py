"""pdserve's vLLM general plugin (pyproject's `vllm.general_plugins` entry point): vLLM calls
`register` in each of its processes (the replica's front, EngineCore, the worker) before an
engine starts.

On a CPU build it makes vLLM's shared-memory queue polling nap instead of yield. EngineCore and
its worker hand each step over a shared-memory ring (vllm/distributed/device_communicators/
shm_broadcast.py); for a second after each read a reader polls it in a loop of
`os.sched_yield()` (vllm/distributed/utils.py `sched_yield`), so an EngineCore spins through
every step its worker computes. On the hosts pdserve runs on here (2 vCPUs) such a loop slows
torch compute on the *other* core by 45-70% (a decode step of SmolLM2's shape: 42-44 ms alone,
63-75 ms beside it), where a loop of 10-100 us sleeps, of another syscall or of plain Python
costs 0-7%. A nap of 0.1 ms (0.15 ms with Linux's timer slack) keeps the loop without the
yields. Measured in the served app (docs/benchmarks.md, "The spinning EngineCore", two runs each
way): chat at one request in flight, TPOT P50 74-75 -> 67-69 ms and ITL P99 580-597 -> 156-157
ms, the same at saturation; naps of 10 us (the timer slack cut to 1 us, 70,000 wake-ups a
second each) were worse than either under load. GPU builds
keep vLLM's loop: their hosts have cores to spare.

`PDSERVE_VLLM_SPIN=yield` keeps vLLM's own loop on CPU too.
"""

from __future__ import annotations

import logging
import os
import time

NAP_S = 1e-4
SPIN_ENV = "PDSERVE_VLLM_SPIN"


def nap() -> None:
    time.sleep(NAP_S)


def register() -> None:
    if os.environ.get(SPIN_ENV, "nap") == "yield":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.distributed.utils as utils
    from vllm.distributed.device_communicators import shm_broadcast

    if not (hasattr(utils, "sched_yield") and hasattr(shm_broadcast, "sched_yield")):
        # A vLLM that polls some other way: nothing of ours to replace.
        logging.getLogger(__name__).warning(
            "vLLM has no shm_broadcast.sched_yield: its step queues poll as vLLM wrote them"
        )
        return
    # shm_broadcast imported the function by name: both bindings are replaced.
    utils.sched_yield = nap
    shm_broadcast.sched_yield = nap
