"""The drafter tuning as the run's backend takes it: a tuning is measured in this package's engine, so under
another backend the drafter keys it set are put back to the drafter's own (``take_back_tuning``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mars_bench.common.paths import CONF_DIR
from mars_bench.config.overrides import search_folders
from mars_bench.config.schema import PLUGIN_GROUPS


def own_engine(backend: str) -> bool:
    """Whether ``backend=backend`` decodes with this package's engine (its ``Backend.own_engine``); False for a name
    no backend registered (its own check refuses it)."""
    from mars_bench.backends.base import backend_class

    try:
        return backend_class(backend).own_engine
    except ValueError:
        return False


def take_back_tuning(cfg: Any) -> None:
    """Under a backend that is not this package's engine, put back, in place, the drafter keys the run's drafter
    tuning (``tuned``) set, and the precision its table per CPU kind set, and set ``tuned`` to null: a tuning is
    measured in this package's engine, as a whole (``gamma=20`` is the cap of confidence-stopped drafts, not a fixed
    length), and another engine runs other drafts. A key the command line typed stays, for the backend's check to
    take or refuse; so does one a later config (an experiment) set to another value. A tuning file found neither in
    conf/ nor on the run's search path stays applied, its keys judged as typed."""
    if not cfg.get("tuned") or own_engine(cfg.backend):
        return
    tuning = option_file(cfg, "drafter_tuning", cfg.tuned)
    if tuning is None:
        return
    typed, loaded = typed_drafter_keys(cfg), drafter_as_loaded(cfg, cfg.drafter.name)
    content = OmegaConf.to_container(OmegaConf.load(tuning), resolve=False)  # as written: a table's rows are interpolations
    written = OmegaConf.to_container(cfg.drafter, resolve=False)
    for key, value in (content.get("drafter") or {}).items():
        if key not in typed and key in loaded and written.get(key) == value:
            cfg.drafter[key] = loaded[key]
    dtype = (content.get("model") or {}).get("dtype")  # a table's precision: the model option's own, likewise
    set_by_table = dtype is not None and OmegaConf.to_container(cfg.model, resolve=False)["dtype"] == dtype
    if set_by_table and "dtype" not in typed_keys(cfg, "model"):
        cfg.model.dtype = model_dtype_as_loaded(cfg)
    cfg.tuned = None
    if "${cpu_tuning" not in str(OmegaConf.to_container(cfg, resolve=False)):  # no value reads the row any more
        cfg.tuned_for = None


def hydra_settings(cfg: Any) -> Any:
    """Hydra's own node of the run (its overrides, its search path): the composed config's, else the running
    job's; None where Hydra runs nothing (a config composed with ``hydra.compose``)."""
    from hydra.core.hydra_config import HydraConfig

    if "hydra" in cfg:
        return cfg.hydra
    return HydraConfig.get() if HydraConfig.initialized() else None


def typed_drafter_keys(cfg: Any) -> set[str]:
    """The drafter keys the command line set (``drafter.KEY=...``); none known outside a Hydra run."""
    return typed_keys(cfg, "drafter")


def typed_keys(cfg: Any, group: str) -> set[str]:
    """The keys of ``group`` the command line set (``GROUP.KEY=...``); none known outside a Hydra run."""
    from mars_bench.bench.folder_names import overridden_keys

    settings = hydra_settings(cfg)
    return overridden_keys([str(item) for item in settings.overrides.task] if settings is not None else [], group)


def model_dtype_as_loaded(cfg: Any) -> str:
    """The dtype the run's model option (``conf/model/<model.name>.yaml``) sets, else the schema's default."""
    from mars_bench.config.schema import ModelConfig

    option = option_file(cfg, "model", cfg.model.name)
    dtype = OmegaConf.load(option).get("dtype") if option is not None else None
    return str(dtype) if dtype is not None else ModelConfig().dtype


def option_file(cfg: Any, group: str, option: str) -> Path | None:
    """``<root>/<group>/<option>.yaml`` in conf/ or a folder of the run's search path (``hydra.searchpath``), or None."""
    settings = hydra_settings(cfg)
    folders = [str(entry) for entry in (settings.searchpath if settings is not None else [])]
    roots = [CONF_DIR, *search_folders([entry for entry in folders if entry.startswith("file://")])]
    return next((path for root in roots if (path := Path(root) / group / f"{option}.yaml").is_file()), None)


def drafter_as_loaded(cfg: Any, name: str) -> dict[str, Any]:
    """The drafter node ``drafter=name`` composes to before any tuning: its schema's defaults, then the keys its
    option file (``conf/drafter/<name>.yaml``) sets."""
    drafters = PLUGIN_GROUPS["drafter"]
    loaded = OmegaConf.structured(drafters.schema(name)) if name in drafters.names() else OmegaConf.create()
    option = option_file(cfg, "drafter", name)
    if option is not None:
        loaded = OmegaConf.merge(loaded, {key: value for key, value in OmegaConf.load(option).items() if key != "defaults"})
    return OmegaConf.to_container(loaded)
