"""What runs inside a serving engine's own environment (vLLM): the acceptance plugin and the worker
that drives the engine for ``backend=vllm``. Nothing here imports transformers or hydra, so that the
engine's environment needs only the engine, torch and this package's verifiers."""
