"""The `tiny` test model: a random-weight Llama with a locally trained byte-level BPE tokenizer.

Built in a second or two, deterministic (same weights and vocabulary on every machine), served by
vLLM like any Hugging Face folder. It makes engine tests fast; its text is nonsense by design.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_VOCAB_SIZE = 512
TINY_SEED = 1234
BOS, EOS, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"

# ChatML, like SmolLM2's, so chat-templated requests behave the same on both models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
Prefill is compute bound: every prompt token passes through every layer once.
Decode is bound by memory bandwidth: each step reads all the weights and the whole KV cache.
A disaggregated server runs the two phases on separate pools and moves the KV cache between them.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
What is the capital of France? The capital of France is Paris.
def add(a, b):\n    return a + b\n
Time to first token, time per output token, goodput, throughput, percentiles.
"""


def _corpus_lines() -> list[str]:
    lines = _CORPUS.splitlines()
    # Numbers and punctuation so every byte pattern a test may send has merges nearby.
    lines += [f"request {i} has {i * 7 % 97} tokens and {i * 13 % 31} blocks." for i in range(200)]
    return lines


def build_tokenizer(dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(dest))


def build_tiny_model(dest: Path, seed: int = TINY_SEED) -> Path:
    """Write the tiny model folder to `dest` (weights, config, tokenizer) and return it.
    Another `seed` gives the same architecture and vocabulary with other weights."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    build_tokenizer(dest)
    tokenizer = AutoTokenizer.from_pretrained(str(dest))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest head size vLLM's CPU attention supports
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        # Wide weights spread the logits, so greedy choices are never float near-ties.
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(dest))
    (dest / "pdserve-model.json").write_text(json.dumps({"name": "tiny", "seed": seed}))
    return dest
