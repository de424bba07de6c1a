"""An in-process vLLM engine (the offline `LLM` class): `pdserve generate` and fast tests.

Served workers use AsyncLLM, which only runs with its engine in child processes; this one keeps
the engine in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so it starts in seconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from engine.messages import TokenLogprobs
from engine.params import GenerationParams
from engine.platform import pin_current_process
from engine.prompts import encode_prompt
from engine.sampling import logprobs_of, to_sampling_params
from engine.settings import EngineSettings


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # Per token, when the params asked for log-probabilities.
    logprobs: tuple[TokenLogprobs, ...] | None = None


class LocalEngine:
    def __init__(self, settings: EngineSettings) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        settings.apply_process_env()
        if settings.device == "cpu" and settings.cpu_cores is not None:
            pin_current_process(settings.cpu_cores)
        from vllm import LLM

        started = time.perf_counter()
        self.settings = settings
        self.llm = LLM(**settings.vllm_kwargs())
        self.start_seconds = time.perf_counter() - started
        self.tokenizer = self.llm.get_tokenizer()

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat=chat)

    def generate(self, prompts: list[list[int]], params: GenerationParams) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
            to_sampling_params(params),
            use_tqdm=False,
        )
        return [
            Completion(
                prompt_token_ids=list(out.prompt_token_ids or []),
                token_ids=list(out.outputs[0].token_ids),
                text=out.outputs[0].text,
                finish_reason=out.outputs[0].finish_reason,
                logprobs=logprobs_of(out.outputs[0], params),
            )
            for out in outputs
        ]
