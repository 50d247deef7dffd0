"""The run's first line: the method it runs, with every drafter and verifier setting, and its drafter tuning."""

from __future__ import annotations

import copy
from typing import Any

from mars_bench.common.settings import plugin_label
from mars_bench.config.method import method_spec
from mars_bench.config.tuning import own_engine, take_back_tuning


def tuning_words(cfg: Any) -> str:
    """What the run's drafter tuning did: ``tuning=cpu (conf/drafter_tuning/<file>.yaml)``, or that none applied
    and why."""
    if cfg.get("tuned"):
        return f"tuning={cfg.tuning} (conf/drafter_tuning/{cfg.tuned}.yaml)"
    if cfg.tuning == "none":
        return "tuning=none (the drafter's own defaults)"
    if not own_engine(cfg.backend):
        return (f"tuning={cfg.tuning} (not applied to backend={cfg.backend}: drafter tunings are measured in this "
                "package's engine; the drafter's own defaults)")  # fmt: skip
    return f"tuning={cfg.tuning} (none measured for model={cfg.model.name} drafter={cfg.drafter.name}: its own defaults)"


def run_line(cfg: Any) -> str:
    """The run's first line: the method it runs with every drafter and verifier setting, and its tuning (as the
    run's backend takes it: ``take_back_tuning``)."""
    cfg = copy.deepcopy(cfg)
    take_back_tuning(cfg)
    try:
        spec = method_spec(cfg)
        drafter = f"{cfg.drafter.name}(length={spec.length.length},{spec.drafter_setting})"
        verifier = plugin_label(cfg.verifier.name, spec.verifier_settings)
    except (TypeError, ValueError):  # refused by the cell, in its own line
        drafter, verifier = cfg.drafter.name, cfg.verifier.name
    return (f"mars_bench: model={cfg.model.name} drafter={drafter} verifier={verifier} task={cfg.task.name} "
            f"temperature={cfg.temperature:g} batch_size={cfg.batch_size}; {tuning_words(cfg)}")  # fmt: skip
