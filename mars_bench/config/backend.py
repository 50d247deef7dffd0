"""The run config that entry points other than the app's cell (the perf suite, the lm-eval model) build their backend
from: the app's ``RunConfig``, holding their method under the keys the app gives it. ``make_backend`` takes it as it
takes a cell's, so every entry point loads and decodes through the one seam (``mars_bench/backends``), and a backend
registered by name (``register_backend``) reaches them all."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mars_bench.config.schema import PLUGIN_GROUPS, ModelConfig, RunConfig
from mars_bench.method import MethodSpec


def backend_config(spec: MethodSpec, model: ModelConfig, backend: str = "transformers", **keys: Any) -> DictConfig:
    """The run config of ``spec`` on ``model`` under ``backend``: the ``drafter`` node holds the spec's drafter, its draft
    length and its own settings, the ``verifier`` node its verifier and settings, and the sampling keys its sampling, so
    that ``config.method_spec`` of it is ``spec``. ``keys``: other top-level keys (``seed``, ``batch_size``, ...); the
    rest keep the schema's defaults. ``spec`` names a verifier, as the app's config always does."""
    if spec.verifier is None:
        raise ValueError("backend_config needs a method with a verifier: allowed are the registered verifiers' specs")
    drafter_node = PLUGIN_GROUPS["drafter"].schema(spec.drafter)
    drafter = drafter_node(**dataclasses.asdict(spec.length), **dataclasses.asdict(spec.drafter_settings))
    verifier_node = PLUGIN_GROUPS["verifier"].schema(spec.verifier)
    verifier = verifier_node(**dataclasses.asdict(spec.verifier_settings), exact_first=spec.exact_first)
    sampling = spec.sampling
    run = RunConfig(model=model, drafter=drafter, verifier=verifier, temperature=sampling.temperature,
                    top_p=sampling.top_p, top_k=sampling.top_k, backend=backend, **keys)  # fmt: skip
    return OmegaConf.structured(run)
