"""Performance suite: our engine against transformers' ``generate`` and assisted generation,
a phase profile and an analytic speedup model (``python -m mars_bench.perf``)."""
