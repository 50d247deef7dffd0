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
    content = OmegaConf.to_container(OmegaConf.load(tuning), resolve=False)  # as written: a table's rows are interpolations
    still_read = False  # a key that reads the table's row stays (typed values are not interpolations)
    for group, loaded in (("drafter", drafter_as_loaded(cfg, cfg.drafter.name)), ("model", model_as_loaded(cfg))):
        typed, written = typed_keys(cfg, group), OmegaConf.to_container(cfg[group], resolve=False)
        for key, value in (content.get(group) or {}).items():
            if written.get(key) != value:  # typed, or set otherwise by a later config (an experiment)
                continue
            if key not in typed and key in loaded:
                cfg[group][key] = loaded[key]
            else:
                still_read = still_read or "${cpu_tuning" in str(value)
    cfg.tuned = None
    if not still_read:  # the manifest names no row of a tuning not applied
        cfg.tuned_for = None


def hydra_settings(cfg: Any) -> Any:
    """Hydra's own node of the run (its overrides, its search path): the composed config's, else the running
    job's; None where Hydra runs nothing (a config composed with ``hydra.compose``)."""
    from hydra.core.hydra_config import HydraConfig

    if "hydra" in cfg:
        return cfg.hydra
    return HydraConfig.get() if HydraConfig.initialized() else None


def typed_keys(cfg: Any, group: str) -> set[str]:
    """The keys of ``group`` the command line set (``GROUP.KEY=...``); none known outside a Hydra run."""
    from mars_bench.bench.folder_names import overridden_keys

    settings = hydra_settings(cfg)
    return overridden_keys([str(item) for item in settings.overrides.task] if settings is not None else [], group)


def model_as_loaded(cfg: Any) -> dict[str, Any]:
    """The model node the run's model option (``conf/model/<model.name>.yaml``) composes to before any tuning: its
    schema's defaults, then the keys its option file sets."""
    from mars_bench.config.schema import ModelConfig

    loaded = OmegaConf.structured(ModelConfig)
    option = option_file(cfg, "model", cfg.model.name)
    if option is not None:
        loaded = OmegaConf.merge(loaded, OmegaConf.load(option))
    return OmegaConf.to_container(loaded)


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
