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

Also on a CPU build: a seeded request's sample in a step that drops it (a chunk of a prefill
that is not its last) leaves the request's random stream where it was. vLLM rewinds a GPU
generator's offset for that (`GPUModelRunner._bookkeeping_sync`), and a CPU generator has no
offset: the EngineCore died on the first such step (`RuntimeError: CPU Generator does not use
offset`), and pdserve seeds every sampled request. Here the generators of the dropped samples
are saved before the sampler runs and restored after it, and the rewind skips them.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

NAP_S = 1e-4
SPIN_ENV = "PDSERVE_VLLM_SPIN"


def nap() -> None:
    time.sleep(NAP_S)


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    keep_dropped_samples_unseen()
    if os.environ.get(SPIN_ENV, "nap") == "yield":
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


def keep_dropped_samples_unseen() -> None:
    """Wrap the model runner's sampling so that the requests whose sample this step drops
    keep their generator's state, and vLLM's offset rewind (GPU generators only) skips them."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner: Any = GPUModelRunner
    if getattr(runner, "_pdserve_dropped_samples_unseen", False):
        return
    if not (hasattr(runner, "_sample") and hasattr(runner, "_bookkeeping_sync")):
        logging.getLogger(__name__).warning(
            "vLLM's model runner has no _sample/_bookkeeping_sync: seeded chunked prefills "
            "sample as vLLM wrote them"
        )
        return
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        if not batch.generators:  # no seeded request in the batch: every step of greedy work
            self._pdserve_restored = ()
            return sample(self, *args, **kwargs)
        dropped = self.discard_request_mask.np[: batch.num_reqs].nonzero()[0]
        saved = {
            int(i): batch.generators[int(i)].get_state()
            for i in dropped
            if int(i) in batch.generators
        }
        output = sample(self, *args, **kwargs)
        for i, state in saved.items():
            batch.generators[i].set_state(state)
        self._pdserve_restored = tuple(saved)
        return output

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        restored = getattr(self, "_pdserve_restored", ())
        self._pdserve_restored = ()
        held = {i: generators.pop(i) for i in restored if i in generators}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    runner._sample = _sample
    runner._bookkeeping_sync = _bookkeeping_sync
    runner._pdserve_dropped_samples_unseen = True
