"""vLLM's NixlConnector, made a good neighbour on CPU hosts.

Loaded by vLLM in every engine process through `kv_connector_module_path`, so the fixes below
apply where the NIXL agent actually lives (the engine's worker child), before it starts:

- NIXL's progress thread busy-polls (`pthrDelay` is hard-coded to 0): each engine burned a
  whole core even idle and decode ran 2x slower beside it. We give it a 200 us poll delay.
- On CPU the connector's worker pins the calling thread to the last core of each NUMA node,
  which is the thread that runs the model: we put its affinity back.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

PROGRESS_THREAD_DELAY_US = 200


class _BindingsWithPollDelay:
    """The NIXL bindings module, except that agents start with a non-zero progress delay."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = max(int(config.pthrDelay), self._delay_us)
        return self._bindings.nixlAgent(name, config)


def tame_progress_thread(delay_us: int = PROGRESS_THREAD_DELAY_US) -> None:
    import nixl._api

    # nixl resolves its CUDA-flavoured build at import; patch the module that agents come from.
    api = vars(sys.modules[nixl._api.nixl_agent.__module__])
    if not isinstance(api["nixlBind"], _BindingsWithPollDelay):
        api["nixlBind"] = _BindingsWithPollDelay(api["nixlBind"], delay_us)


class PdNixlConnector(NixlConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        tame_progress_thread()
        affinity = os.sched_getaffinity(0)
        try:
            super().__init__(*args, **kwargs)
        finally:
            os.sched_setaffinity(0, affinity)
