"""PrefillServer: the prefill pool's Serve deployment, one PrefillWorker per replica."""

from __future__ import annotations

from deploy.config import AppConfig
from deploy.engines import engine_settings, served_transfer_settings
from engine.autoscaling_stats import PrefillWindow
from engine.messages import GenerationRequest, PrefillResult
from engine.replica import ReplicaShell
from prefill_workers.worker import PrefillWorker


class PrefillServer(ReplicaShell):
    pool = "prefill"

    def __init__(self, config: AppConfig) -> None:
        worker = PrefillWorker(engine_settings(config, "prefill"), served_transfer_settings(config))
        self.start_engine(worker, config.control.redis_url, config.name)
        self._window = PrefillWindow(config.autoscaling.window_s, config.autoscaling.percentile)

    @property
    def num_pending_prefill_tokens(self) -> int:
        return self._window.num_pending_tokens

    async def prefill(self, request: GenerationRequest) -> PrefillResult:
        token = self._window.request_started(request.num_prompt_tokens)
        try:
            result: PrefillResult = await self._engine_owner.prefill(request)
        except BaseException:  # cancelled too: its tokens must not stay pending
            self._window.request_aborted(token)
            raise
        self._window.request_finished(
            token, queue_wait_s=result.engine_queue_seconds, compute_s=result.prefill_seconds
        )
        return result

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Pushed to the Serve controller for the prefill pool's SLO policy."""
        return self._window.report()
