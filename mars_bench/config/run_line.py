"""The run's first line: the method it runs, with every drafter and verifier setting, and its drafter tuning."""

from __future__ import annotations

from typing import Any

from mars_bench.config.tuning import own_engine
from mars_bench.method import MethodSpec


def tuning_words(cfg: Any) -> str:
    """What the run's drafter tuning did: ``tuning=cpu (conf/drafter_tuning/<file>.yaml)``, with its table's row for
    the run's CPU kind where it has one (a value set over the row's named with the one in effect), or that none
    applied and why."""
    if cfg.get("tuned"):
        kind = cfg.get("tuned_for")
        if kind is None or kind not in (cfg.get("cpu_tuning") or {}):
            return f"tuning={cfg.tuning} (conf/drafter_tuning/{cfg.tuned}.yaml)"
        row = cfg.cpu_tuning[kind]
        chosen = []
        for key, value, in_effect in (("dtype", row.dtype, cfg.model.dtype),
                                      ("weights", row.weights, cfg.drafter.get("weights"))):  # fmt: skip
            chosen.append(f"{key}={value}" + ("" if in_effect == value else f" (in effect: {in_effect})"))
        return f"tuning={cfg.tuning} for CPU kind {kind} (conf/drafter_tuning/{cfg.tuned}.yaml: {', '.join(chosen)})"
    if cfg.tuning == "none":
        return "tuning=none (the drafter's own defaults)"
    if not own_engine(cfg.backend):
        return (f"tuning={cfg.tuning} (not applied to backend={cfg.backend}: drafter tunings are measured in this "
                "package's engine; the drafter's own defaults)")  # fmt: skip
    return f"tuning={cfg.tuning} (none measured for model={cfg.model.name} drafter={cfg.drafter.name}: its own defaults)"


def run_line(cfg: Any, spec: MethodSpec | None) -> str:
    """The run's first line: the method ``spec`` it runs with every drafter and verifier setting (None: a method the
    config cannot build, which the cell refuses in its own line: the names alone), and its tuning. ``cfg``: the config
    as the run's backend takes it (``take_back_tuning`` done)."""
    drafter, verifier = cfg.drafter.name, cfg.verifier.name
    if spec is not None:
        drafter = f"{drafter}(length={spec.length.length},{spec.drafter_setting})"
        verifier = spec.verifier_label
    return (f"mars_bench: model={cfg.model.name} dtype={cfg.model.dtype} drafter={drafter} verifier={verifier} "
            f"task={cfg.task.name} temperature={cfg.temperature:g} batch_size={cfg.batch_size}; {tuning_words(cfg)}")  # fmt: skip
