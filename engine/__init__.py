"""vLLM engine settings shared by both pools, model resolution and the transformers oracle."""
