"""The simulated engine (`engine.kind: sim`): an AsyncLLM stand-in whose steps take the time a
profile says, for running the whole app at GPU scale on a machine without GPUs."""
