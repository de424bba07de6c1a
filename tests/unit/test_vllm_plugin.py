"""pdserve's vLLM general plugin (engine/vllm_plugin.py): registered where vLLM looks for it, and
on this CPU build it swaps the shared-memory queues' sched_yield polling for a nap."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import vllm.distributed.utils as utils
from vllm.distributed.device_communicators import shm_broadcast

from engine import vllm_plugin


def test_vllm_finds_the_plugin_among_its_general_plugins() -> None:
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("pdserve") == "engine.vllm_plugin:register", found


def vllm_s_loop() -> None:
    """Stands in for vLLM's own `sched_yield` (a test before this one may have loaded vLLM's
    plugins in this process already)."""


@pytest.fixture
def unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both bindings as vLLM's, put back as they were after the test."""
    monkeypatch.setattr(utils, "sched_yield", vllm_s_loop)
    monkeypatch.setattr(shm_broadcast, "sched_yield", vllm_s_loop)


@pytest.mark.usefixtures("unpatched")
def test_on_cpu_the_queues_nap_instead_of_yielding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.SPIN_ENV, raising=False)
    vllm_plugin.register()
    assert utils.sched_yield is vllm_plugin.nap and shm_broadcast.sched_yield is vllm_plugin.nap
    vllm_plugin.register()  # vLLM may load its plugins more than once in a process
    assert shm_broadcast.sched_yield is vllm_plugin.nap


@pytest.mark.usefixtures("unpatched")
def test_the_environment_keeps_vllm_s_own_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "yield")
    vllm_plugin.register()
    assert shm_broadcast.sched_yield is vllm_s_loop and utils.sched_yield is vllm_s_loop
