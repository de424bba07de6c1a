"""The test oracle: the same model run by transformers' own `generate`, in float32 on CPU."""

from __future__ import annotations

from pathlib import Path

from engine.params import GenerationParams


class ReferenceModel:
    """transformers' LlamaForCausalLM (or whatever the folder holds), greedy decoding."""

    def __init__(self, model_path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        self.model.eval()
        self.eos_token_id = self.model.generation_config.eos_token_id

    def generate(self, prompt_token_ids: list[int], params: GenerationParams) -> list[int]:
        """New token ids, the stop token included, as vLLM reports them."""
        import torch

        if not params.is_greedy:
            raise ValueError("the transformers oracle only checks greedy decoding")
        input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=params.max_tokens,
                do_sample=False,
                eos_token_id=None if params.ignore_eos else self.eos_token_id,
                pad_token_id=self.eos_token_id if self.eos_token_id is not None else 0,
                # Without this, generate also stops at generation_config's own stop strings.
                min_new_tokens=params.max_tokens if params.ignore_eos else 0,
            )
        return [int(t) for t in out[0, len(prompt_token_ids) :]]
