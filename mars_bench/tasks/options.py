"""A task option (``conf/task/<name>.yaml``) as a task config, outside the Hydra app: for the perf
suite and the lm-eval example, which load the app's prompt sets without composing a run."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from mars_bench.common.paths import CONF_DIR

CONF_TASKS = CONF_DIR / "task"


def task_option(name: str, **overrides: Any) -> Any:
    """The task option ``name`` over the task schema's defaults, with ``overrides`` (e.g. num_prompts);
    ValueError in one line for a name that is not an option."""
    from mars_bench.config.schema import TaskConfig

    option = CONF_TASKS / f"{name}.yaml"
    if not option.is_file():
        choices = ", ".join(sorted(path.stem for path in CONF_TASKS.glob("*.yaml")))
        raise ValueError(f"task {name!r} is unknown: allowed are {choices}")
    return OmegaConf.merge(OmegaConf.structured(TaskConfig), OmegaConf.load(option), overrides)
