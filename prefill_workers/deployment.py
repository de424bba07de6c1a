"""PrefillServer: the prefill pool's Serve deployment, one PrefillWorker per replica."""

from __future__ import annotations

from engine.autoscaling_stats import PrefillWindow
from engine.messages import GenerationRequest, PrefillResult
from kv_transfer.endpoint import served_transfer_settings
from prefill_workers.replica import ReplicaSettings, ReplicaShell
from prefill_workers.worker import PrefillWorker


class PrefillServer(ReplicaShell):
    pool = "prefill"

    def __init__(self, settings: ReplicaSettings) -> None:
        transfer = served_transfer_settings(settings.require_transfer())
        # Its handoffs' KV lives until pulled or until their lease ends: a stopping replica
        # keeps serving those pulls as long.
        self.drain_timeout_s = transfer.lease_seconds
        self._worker = PrefillWorker(settings.engine.resolve(), transfer)
        self.start_engine(self._worker, settings.status)
        self._window = PrefillWindow(settings.window_s, settings.percentile)

    @property
    def num_pending_prefill_tokens(self) -> int:
        return self._window.num_pending_tokens

    async def prefill(
        self, request: GenerationRequest, avoid: tuple[str, ...] = ()
    ) -> PrefillResult:
        """`avoid` is for the request router (replicas that failed this request)."""
        token = self._window.request_started(request.num_prompt_tokens)
        try:
            with self.failures_named():
                result = await self._worker.prefill(request)
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
