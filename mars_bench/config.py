"""The structured config schema (registered in Hydra's ConfigStore).

A misspelt key or a value of the wrong type fails at start with Hydra's own message;
values that types cannot check (ranges, names) are checked by ``check_run_config``
before any model is loaded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from mars_bench.common.kernels import DEFAULT_KERNELS, check_kernels
from mars_bench.common.paths import CONF_DIR
from mars_bench.common.settings import parse_label, plugin_label
from mars_bench.decoding.draft_length import DEFAULT_LENGTH, DraftLengthSettings
from mars_bench.decoding.engine import DecodeSettings
from mars_bench.drafting import (
    available_drafters,
    drafter_needs_model,
    drafter_settings,
    drafters_without_model,
)
from mars_bench.drafting.batched import cli_value, one_sequence_setting
from mars_bench.method import MethodSpec, check_tree_judges
from mars_bench.models.placement import check_memory_budget, parse_dtype
from mars_bench.verification import available_verifiers, get_verifier, verifier_settings
from mars_bench.verification.sampling import SamplingParams


@dataclass
class ResourcesConfig:
    """What one job of this model needs on a cluster (hydra/launcher=slurm reads it)."""

    gpus: int | None = None  # GPUs per job, the target sharded over them (device_map); null: a CPU job
    cpus: int = 8  # CPU cores per job
    mem_gb: int = 32  # host memory per job (loading reads the weights through it)
    timeout_min: int = 240  # the job's time limit; a job that reaches it is requeued and resumes


@dataclass
class ModelConfig:
    """A target and (for drafter=model) its separate draft model, by Hub id or local folder."""

    name: str = "qwen2.5-coder-1.5b"
    target: str = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    draft_model: str | None = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    eagle3_head: str | None = None  # the EAGLE-3 draft head for drafter=eagle3 (a folder or Hub id)
    dtype: str = "bfloat16"
    device_map: str | None = None
    # per device (0, 1, ..., cpu, disk): the target's budget, e.g. {0: 70GiB, 1: 70GiB}. Typed Any: Hydra
    # cannot put a command line's model.max_memory='{0:70GiB,1:70GiB}' into a None typed as a dict.
    max_memory: Any = None
    offload_folder: str | None = None  # a folder allows disk offload
    attn_implementation: str = "sdpa"
    kernels: str = DEFAULT_KERNELS  # linear layers on the CPU: auto | onednn | stock (mars_bench/models/cpu_linear.py)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


@dataclass
class VllmGpuConfig:
    """vLLM's GPU settings (``backend=vllm`` only; ``backends/vllm_placement.py`` plans them before any engine loads)."""

    tensor_parallel_size: int = 1  # GPUs each engine shards its target (and drafter) over
    gpu_memory_utilization: float = 0.9  # the share of each GPU's memory vLLM takes (vLLM's own default)
    # GiB per GPU (2^30 bytes, as torch.cuda counts a GPU's memory) that the plan checks against; null: read from the
    # GPUs this process sees. Set it to check a plan on a machine without them (docs/vllm.md#on-gpus).
    gpu_memory_gb: float | None = None


@dataclass
class DrafterCommon:
    """The keys every drafter takes: the engine's draft length. Each drafter's own settings are
    declared once, by the drafter (``drafter_settings(name)``), and added by ``settings_schema``."""

    name: str = "model"
    gamma: int = DEFAULT_LENGTH.gamma  # drafted tokens per step (a tree's depth)
    length: str = DEFAULT_LENGTH.length  # draft-length policy: fixed | schedule (adapts to acceptance) | confidence | gain
    max_gamma: int = DEFAULT_LENGTH.max_gamma  # schedule: the most drafts per step
    min_confidence: float = DEFAULT_LENGTH.min_confidence  # confidence: stop drafting after a draft with q below this
    draft_cost: float = DEFAULT_LENGTH.draft_cost  # gain: one more drafted token's cost, in target forwards


@dataclass
class VerifierCommon:
    """The verifier's name; its settings are declared once, by the verifier (``verifier_settings(name)``)."""

    name: str = "mars"


def settings_schema(common: type, settings: dict[str, type]) -> tuple[type, dict[str, type]]:
    """The structured config of a plugin group, built from the plugins' own settings dataclasses.

    Returns the group's union of keys (the common keys plus every plugin's settings; a key two plugins
    share takes the first one's default), which only the checks of a command line's keys and value
    types read, and, per plugin, a subclass of ``common`` with that plugin's own keys and defaults and
    no other plugin's (``conf/<group>/<name>.yaml`` extends it, stored as ``schema_name(group, name)``),
    so that ``verifier=exact verifier.theta=0.5`` has no key to set.
    """
    hints: dict[str, Any] = {}
    own_defaults: dict[str, dict[str, Any]] = {}
    for plugin, settings_class in settings.items():
        types = get_type_hints(settings_class)
        own_defaults[plugin] = {item.name: _default(item) for item in fields(settings_class)}
        for key in own_defaults[plugin]:
            if hints.setdefault(key, types[key]) != types[key]:
                raise TypeError(f"setting {key!r} of {plugin} has type {types[key]}, another plugin's has {hints[key]}")
    first: dict[str, Any] = {}
    for defaults in own_defaults.values():
        for key, value in defaults.items():
            first.setdefault(key, value)
    union = [(key, hints[key], field(default=value)) for key, value in first.items()]
    schema = make_dataclass(common.__name__.replace("Common", "Config"), union, bases=(common,))
    per_plugin = {
        plugin: make_dataclass(f"{plugin}_schema", [("name", str, field(default=plugin)),
                               *((key, hints[key], field(default=value)) for key, value in defaults.items())],
                               bases=(common,))  # fmt: skip
        for plugin, defaults in own_defaults.items()
    }
    return schema, per_plugin


def _default(item: Any) -> Any:
    if item.default is not MISSING:
        return item.default
    if item.default_factory is not MISSING:
        return item.default_factory()
    raise TypeError(f"setting {item.name!r} has no default")


DrafterConfig, DRAFTER_SCHEMAS = settings_schema(DrafterCommon, {name: drafter_settings(name) for name in available_drafters()})
VerifierConfig, VERIFIER_SCHEMAS = settings_schema(
    VerifierCommon, {name: verifier_settings(name) for name in available_verifiers()}
)


@dataclass
class TaskConfig:
    name: str = "humaneval"
    dataset: str | None = None  # the benchmark whose questions the hub and package sources serve; null: name
    file: str = "humaneval/question.jsonl"  # absolute, or relative to data_dir
    sources: list[str] = field(default_factory=lambda: ["file", "hub", "package"])  # tried in this order
    num_prompts: int | None = 10  # the first N questions; null = all
    max_turns: int | None = None  # the first N turns of each question (MT-bench has 2); null = all
    system_prompt: str | None = None
    scorer: str | None = None
    judge_model: str | None = None  # for scorer=judge: any causal LM, by Hub id or folder
    judge_max_new_tokens: int = 512
    # The prompt format (tasks/prompting.py): each user turn wrapped in `instruction` ({question}: the turn less
    # drop_prefix), the reply begun with answer_prefix in the prompt, answers ended at stop_strings too.
    instruction: str | None = None
    drop_prefix: str = ""
    answer_prefix: str = ""
    stop_strings: list[str] = field(default_factory=list)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    # Typed by the keys every plugin takes: the chosen plugin's schema (conf/<group>/<name>.yaml) brings its own.
    drafter: DrafterCommon = field(default_factory=DrafterCommon)
    verifier: VerifierCommon = field(default_factory=VerifierCommon)
    task: TaskConfig = field(default_factory=TaskConfig)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0
    batch_size: int = 1  # prompts decoded together by the batched engine (decoding/batched.py); 1: one at a time
    backend: str = "transformers"  # what runs the method (mars_bench/backends): this package's engine on transformers
    vllm: VllmGpuConfig = field(default_factory=VllmGpuConfig)  # backend=vllm's GPU settings
    # The drafter tuning choice (conf/tuning): cpu applies a model's drafter settings measured on the CPU where
    # conf/drafter_tuning/<model>_<drafter>_cpu.yaml has them, on any machine; none drafts with the drafter's defaults.
    tuning: str = "none"
    tuned: str | None = None  # the drafter tuning file that set this run's drafter settings (null: none did)
    warmup: int = 1  # warm-up decodes per method before timing (on a short prompt)
    threads: int | None = None  # torch CPU threads; null = all cores
    data_dir: str | None = None  # null: $MARS_BENCH_DATA, else ../shared/data beside the repository
    output_dir: str | None = None  # null: Hydra's run folder
    progress: bool = True
    shadow: list[str] = field(default_factory=list)  # verifiers judged beside the live one (same drafts, same logits)
    fidelity: bool = False  # record each verifier's exact acceptance, KL and TV against the target per position
    baseline_cache: str | None = None  # a folder shared by the cells of a sweep: each baseline decoded once
    # Contention (bench/contention.py): a timed row is disturbed when other processes kept more than
    # disturbed_load cores busy on average, or used more than disturbed_gpu_util percent of a GPU.
    disturbed_load: float = 0.25
    disturbed_gpu_util: float = 10.0
    retry_disturbed: int = 0  # re-time a disturbed row up to this many times, each once the machine is idle
    include_disturbed: bool = False  # count disturbed rows in the run's speedups (left out by default)
    # Scores without speed (experiment=accuracy): the method alone, no paired baseline, no warm-up, untimed.
    # A lossless verifier scores the target itself; a lossy one only with lossy_accuracy=true (its own accuracy).
    accuracy_only: bool = False
    lossy_accuracy: bool = False
    include_cut: bool = False  # score changes against the baseline count prompts whose answers were cut at the budget too


def schema_name(group: str, plugin: str) -> str:
    """The ConfigStore name of a plugin's schema, which ``conf/<group>/<plugin>.yaml`` extends
    (``- /<group>_<plugin>_schema@_here_``)."""
    return f"{group}_{plugin}_schema"


def register_configs() -> None:
    """Store the schemas (the config's resolvers: ``bench.run_folder.register_resolvers``).

    The schemas are stored outside every config group (at the root, as primary configs are), so that
    Hydra neither lists them among a group's options (``--help``, its error for an unknown option) nor
    takes one as a choice: ``verifier=verifier_mars_schema`` is an unknown option."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, schemas in (("drafter", DRAFTER_SCHEMAS), ("verifier", VERIFIER_SCHEMAS)):
        for name, schema in schemas.items():
            store.store(name=schema_name(group, name), node=schema)


def plugin_settings(settings_class: type, config: Any) -> dict[str, Any]:
    """The values of ``settings_class``'s fields that a config node (a drafter's or verifier's) has."""
    return {item.name: getattr(config, item.name) for item in fields(settings_class) if item.name in config}


def verifier_params(verifier: Any) -> dict[str, Any]:
    """The settings the named verifier takes, from the ``verifier`` config node."""
    return plugin_settings(verifier_settings(verifier.name), verifier)


def drafter_params(drafter: Any) -> dict[str, Any]:
    """The settings the named drafter takes, from the ``drafter`` config node."""
    return plugin_settings(drafter_settings(drafter.name), drafter)


def method_spec(cfg: Any) -> MethodSpec:
    """The configured method: the ``drafter`` node (name, draft length, the drafter's own settings), the
    ``verifier`` node and the sampling keys, checked (ValueError, one line)."""
    drafter = cfg.drafter
    settings = drafter_params(drafter)
    return MethodSpec.create(
        drafter.name,
        cfg.verifier.name,
        drafter_settings=settings,
        verifier_settings=verifier_params(cfg.verifier),
        length=DraftLengthSettings(drafter.length, drafter.gamma, drafter.max_gamma, drafter.min_confidence, drafter.draft_cost),
        sampling=SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k),
    )


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
    tuning (``tuned``) set, and set ``tuned`` to null: a tuning is measured in this package's engine, as a whole
    (``gamma=20`` is the cap of confidence-stopped drafts, not a fixed length), and another engine runs other
    drafts. A key the command line typed stays, for the backend's check to take or refuse; so does one a later
    config (an experiment) set to another value. A tuning file found neither in conf/ nor on the run's search
    path stays applied, its keys judged as typed."""
    if not cfg.get("tuned") or own_engine(cfg.backend):
        return
    tuning = option_file(cfg, "drafter_tuning", cfg.tuned)
    if tuning is None:
        return
    typed, loaded = typed_drafter_keys(cfg), drafter_as_loaded(cfg, cfg.drafter.name)
    for key, value in (OmegaConf.load(tuning).get("drafter") or {}).items():
        if key not in typed and key in loaded and cfg.drafter[key] == value:
            cfg.drafter[key] = loaded[key]
    cfg.tuned = None


def hydra_settings(cfg: Any) -> Any:
    """Hydra's own node of the run (its overrides, its search path): the composed config's, else the running
    job's; None where Hydra runs nothing (a config composed with ``hydra.compose``)."""
    from hydra.core.hydra_config import HydraConfig

    if "hydra" in cfg:
        return cfg.hydra
    return HydraConfig.get() if HydraConfig.initialized() else None


def typed_drafter_keys(cfg: Any) -> set[str]:
    """The drafter keys the command line set (``drafter.KEY=...``); none known outside a Hydra run."""
    from mars_bench.bench.folder_names import overridden_keys

    settings = hydra_settings(cfg)
    return overridden_keys([str(item) for item in settings.overrides.task] if settings is not None else [], "drafter")


def option_file(cfg: Any, group: str, option: str) -> Path | None:
    """``<root>/<group>/<option>.yaml`` in conf/ or a folder of the run's search path (``hydra.searchpath``), or None."""
    settings = hydra_settings(cfg)
    folders = [str(entry) for entry in (settings.searchpath if settings is not None else [])]
    roots = [CONF_DIR, *search_folders([entry for entry in folders if entry.startswith("file://")])]
    return next((path for root in roots if (path := Path(root) / group / f"{option}.yaml").is_file()), None)


def search_folders(entries: list[str]) -> list[Path]:
    """The folders of ``hydra.searchpath`` entries (``file://FOLDER``)."""
    return [Path(entry.removeprefix("file://")) for entry in entries]


def drafter_as_loaded(cfg: Any, name: str) -> dict[str, Any]:
    """The drafter node ``drafter=name`` composes to before any tuning: its schema's defaults, then the keys its
    option file (``conf/drafter/<name>.yaml``) sets."""
    loaded = OmegaConf.structured(DRAFTER_SCHEMAS[name]) if name in DRAFTER_SCHEMAS else OmegaConf.create()
    option = option_file(cfg, "drafter", name)
    if option is not None:
        loaded = OmegaConf.merge(loaded, {key: value for key, value in OmegaConf.load(option).items() if key != "defaults"})
    return OmegaConf.to_container(loaded)


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


def shadow_verifiers(cfg: Any) -> dict[str, Any]:
    """label -> Verifier for each entry of ``cfg.shadow``: a name (``mars``) takes the settings that
    the live verifier shares with it (its own, for a shadow of the live verifier; ``theta`` of a live
    ``mars_ref`` for a ``mars`` shadow), the rest at its defaults; a spec with settings (``mars(theta=0.8)``,
    ``tv_budget(eps=0.05)``) sets those and leaves the rest at the verifier's defaults.

    The label is the name with its settings: ``mars(theta=0.9,guard=never,correction=residual)``."""
    shadows = {}
    for spec in cfg.shadow:
        name, settings = parse_label(str(spec))
        if name not in available_verifiers():
            raise ValueError(f"shadow verifier {name!r} is unknown: allowed are {', '.join(available_verifiers())}")
        if not settings:
            settings = plugin_settings(verifier_settings(name), cfg.verifier)
        try:
            verifier = get_verifier(name, **settings)
        except (TypeError, ValueError) as error:
            raise ValueError(f"shadow {spec!r}: {error}") from None
        label = plugin_label(name, verifier.params)
        if label in shadows:
            raise ValueError(f"shadow {spec!r} repeats {label}: each shadow verifier must differ")
        shadows[label] = verifier
    return shadows


@dataclass(frozen=True)
class PluginGroup:
    """A config group of plugins: its common keys, its schema (with every plugin's settings), the
    settings class of a plugin by name and the registered names."""

    common: type
    schema: type
    settings_of: Callable[[str], type]
    names: Callable[[], list[str]]


PLUGIN_GROUPS = {
    "drafter": PluginGroup(DrafterCommon, DrafterConfig, drafter_settings, available_drafters),
    "verifier": PluginGroup(VerifierCommon, VerifierConfig, verifier_settings, available_verifiers),
}


def allowed_keys(group: str) -> str:
    """The keys of a drafter or verifier config node, as an error lists them: the common ones, then
    each plugin's own settings."""
    plugins = PLUGIN_GROUPS[group]
    own = [f"{name}: {' '.join(sorted(item.name for item in keys))}"
           for name in plugins.names() if (keys := fields(plugins.settings_of(name)))]  # fmt: skip
    common = ", ".join(item.name for item in fields(plugins.common))
    return common + (f"; {group} settings: {'; '.join(own)}" if own else "")


def check_override_keys(overrides: list[str]) -> None:
    """Refuse a command-line ``drafter.KEY=...`` or ``verifier.KEY=...`` whose KEY no drafter or verifier
    declares, or that the chosen one does not take (``verifier=exact verifier.theta=0.5``), in one line
    naming the allowed keys (Hydra's own message would not name them)."""
    for override in overrides:
        group, dot, rest = override.lstrip("+~").partition(".")
        key = rest.split("=", 1)[0]
        if not dot or group not in PLUGIN_GROUPS:
            continue
        plugins = PLUGIN_GROUPS[group]
        if key not in {item.name for item in fields(plugins.schema)}:
            raise ValueError(f"{group}.{key} is not a {group} setting: allowed are {allowed_keys(group)}")
        common = {item.name for item in fields(plugins.common)}
        for name in chosen_plugins(group, overrides):
            own = [item.name for item in fields(plugins.settings_of(name))] if name in plugins.names() else None
            if own is not None and key not in common and key not in own:
                allowed = [*(item.name for item in fields(plugins.common) if item.name != "name"), *own]
                words = f"allowed are {', '.join(allowed)}" if allowed else f"{group}={name} takes no settings"
                raise ValueError(f"{group}.{key} is not a setting of {group}={name}: {words}")


def chosen_plugins(group: str, overrides: list[str]) -> list[str]:
    """The ``group`` options (verifiers, drafters) a command line runs: its ``group=...`` values, else the
    chosen experiment's ``override /group``, else conf/config.yaml's default; empty where it cannot tell."""
    choices = [value for override in parsed_overrides(overrides) if override.key_or_group == group
               for value in override_values(override)]  # fmt: skip
    if choices:
        return [str(value) for value in choices]
    experiments = [value for override in parsed_overrides(overrides) if override.key_or_group == "experiment"
                   for value in override_values(override)]  # fmt: skip
    for experiment in experiments:
        if (chosen := default_choice(CONF_DIR / "experiment" / f"{experiment}.yaml", f"override /{group}")) is not None:
            return [chosen]
    default = default_choice(CONF_DIR / "config.yaml", group)
    return [] if default is None else [default]


def default_choice(path: Path, entry: str) -> str | None:
    """The option a config file's defaults list gives ``entry`` (``verifier``, ``override /verifier``), or None."""
    if not path.is_file():
        return None
    for item in OmegaConf.load(path).get("defaults", []) or []:
        if isinstance(item, dict) or OmegaConf.is_dict(item):
            for name, value in dict(item).items():
                if name == entry and value is not None:
                    return str(value)
    return None


ELSEWHERE = ("-cd", "--config-dir", "-cp", "--config-path", "-cn", "--config-name")  # flags that read other configs


def parsed_overrides(argv: list[str]) -> list[Any]:
    """The command line's overrides as Hydra parses them; a word Hydra cannot parse (or a flag's value) is
    left out, for Hydra itself to report."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, parsed = OverridesParser.create(), []
    for word in argv:
        if word.startswith("-"):
            continue
        try:
            parsed += parser.parse_overrides([word])
        except HydraException:
            continue
    return parsed


def override_values(override: Any) -> list[Any]:
    """The values an override sets: one, or each of a choice sweep's (none for ranges, globs and deletions)."""
    from hydra.core.override_parser.types import ValueType

    if override.is_delete():
        return []
    if override.value_type == ValueType.ELEMENT:
        return [override.value()]
    if override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        return list(override.sweep_iterator())
    return []


def group_options(roots: list[Path]) -> dict[str, list[str]]:
    """Each config group below the config folders ``roots`` (``<root>/<group>/<option>.yaml``), with its options."""
    options: dict[str, set[str]] = {}
    for root in roots:
        for path in root.glob("*/*.yaml"):
            options.setdefault(path.parent.name, set()).add(path.stem)
    options.pop("hydra", None)  # Hydra's own groups (hydra/launcher: mars_bench.common.extras.check_launcher)
    return {group: sorted(names) for group, names in options.items()}


def check_group_choices(argv: list[str]) -> None:
    """Refuse a command-line ``group=option`` whose group has no such option, in one line with the closest
    option (Hydra's own message lists every option over many lines). The groups are the folders of
    ``conf/`` and of a ``hydra.searchpath`` folder; a command that reads configs from elsewhere (``-cd``,
    ``-cp``, ``-cn``, a search path that is not a folder) is left to Hydra."""
    import difflib

    if any(word.split("=", 1)[0] in ELSEWHERE for word in argv):
        return
    overrides = parsed_overrides(argv)
    roots = [CONF_DIR]
    for override in overrides:
        for value in override_values(override) if override.key_or_group == "hydra.searchpath" else []:
            entries = [str(entry) for entry in (value if isinstance(value, list) else [value])]
            if not all(entry.startswith("file://") for entry in entries):
                return
            roots += search_folders(entries)
    options = group_options(roots)
    for override in overrides:
        group = override.key_or_group
        for choice in override_values(override) if group in options else []:
            if choice is not None and str(choice) not in options[group]:
                close = difflib.get_close_matches(str(choice), options[group], n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"{group}={choice} is not a {group} option{hint}: allowed are {', '.join(options[group])}")


def schema_type(key: str) -> Any:
    """The declared type of the config leaf ``key`` (``verifier.theta``: ``float | None``); None where the
    schema declares none (a group, a key inside a free-form value, an unknown key)."""
    node: Any = RunConfig
    unions = {group.common: group.schema for group in PLUGIN_GROUPS.values()}  # any plugin's key, by its type
    for part in key.split("."):
        hints = get_type_hints(unions.get(node, node)) if is_dataclass(node) else {}
        if part not in hints:
            return None
        node = hints[part]
    return None if is_dataclass(node) else node


def allowed_values(hint: Any) -> str:
    """What a value of type ``hint`` may be, as the command line writes it."""
    members = [member for member in get_args(hint) if member is not type(None)] if get_origin(hint) in UNIONS else [hint]
    words = {float: "a number", int: "an integer", bool: "true or false", str: "a string", list: "a list [a,b]",
             dict: "a mapping {key:value}"}  # fmt: skip
    text = " or ".join(words.get(get_origin(member) or member, str(member)) for member in members)
    return text + (" or null" if type(None) in get_args(hint) else "")


UNIONS = (Union, UnionType)


def check_override_values(argv: list[str]) -> None:
    """Refuse a command-line ``key=value`` whose value the key's declared type cannot take (``verifier.theta=abc``)
    in one line naming the key, the value and what is allowed (OmegaConf's own message takes several lines).
    The type is checked as Hydra will check it, by assigning the value to a structured node of that type."""
    from omegaconf.errors import ValidationError

    for override in parsed_overrides(argv):
        hint = schema_type(override.key_or_group)
        if hint is None or hint is Any:
            continue
        probe = OmegaConf.structured(make_dataclass("Probe", [("value", hint, field(default=MISSING))]))
        for value in override_values(override):
            try:
                probe.value = value
            except ValidationError:
                shown = value if override.is_sweep_override() else override.input_line.split("=", 1)[1]  # as typed
                raise ValueError(f"{override.key_or_group}={shown} is invalid: allowed is {allowed_values(hint)}") from None


def check_slurm_sweep(overrides: list[str]) -> None:
    """Refuse, in one line, a sweep over ``model`` or ``model.resources.*`` under ``hydra/launcher=slurm``:
    Hydra sizes every job of a sweep from one composition, so each target would get the first one's
    GPUs and memory. One sweep per target is right (the Table 1 recipe in docs/clusters.md)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except HydraException:
        return  # Hydra itself reports a malformed override
    if not any(o.key_or_group == "hydra/launcher" and o.value() == "slurm" for o in parsed):
        return
    for override in parsed:
        key = override.key_or_group
        if override.is_sweep_override() and (key == "model" or key.startswith("model.resources")):
            raise ValueError(
                f"{override.input_line} under hydra/launcher=slurm: every job of a sweep is sized from one "
                f"composition, so these jobs would not get their own resources; allowed is one value of {key} "
                "per sweep (run the command once for each)"
            )


def check_accuracy_mode(cfg: Any) -> None:
    """Refuse, in one line, ``accuracy_only`` with a lossy verifier unless ``lossy_accuracy`` asks for its accuracy."""
    if cfg.accuracy_only and not get_verifier(cfg.verifier.name).lossless and not cfg.lossy_accuracy:
        raise ValueError(
            f"verifier={cfg.verifier.name} is lossy: accuracy_only scores the target through a lossless verifier "
            f"(allowed: {', '.join(lossless_verifiers())}); add lossy_accuracy=true to score {cfg.verifier.name}'s own answers"
        )


def lossless_verifiers() -> list[str]:
    """The registered verifiers that emit exactly what the target alone would."""
    return [name for name in available_verifiers() if get_verifier(name).lossless]


def check_batch_settings(cfg: Any) -> None:
    """Refuse, in one line, a drafter setting that rides on one sequence's drafter at ``batch_size`` > 1
    (a batch would draft without it, running another method than the command names)."""
    if (found := one_sequence_setting(drafter_params(cfg.drafter))) is not None:
        key, value, off, reason = found
        source = f" (set by tuning={cfg.tuning}; tuning=none drafts without it)" if cfg.get("tuned") else ""
        raise ValueError(f"drafter.{key}={cli_value(value)}{source} {reason}: allowed at batch_size={cfg.batch_size} "
                         f"is drafter.{key}={cli_value(off)}")


def check_vllm_settings(cfg: Any) -> None:
    """Refuse, in one line, a ``vllm.*`` value out of range, or any set under a backend other than vLLM's."""
    from mars_bench.backends.vllm import VllmBackend

    settings = cfg.vllm
    if settings.tensor_parallel_size < 1:
        raise ValueError(f"vllm.tensor_parallel_size={settings.tensor_parallel_size} is invalid: allowed is a number of "
                         "GPUs >= 1")  # fmt: skip
    if not 0 < settings.gpu_memory_utilization <= 1:
        raise ValueError(f"vllm.gpu_memory_utilization={settings.gpu_memory_utilization} is invalid: allowed is a share "
                         "of each GPU's memory in (0, 1]")  # fmt: skip
    if settings.gpu_memory_gb is not None and not settings.gpu_memory_gb > 0:
        raise ValueError(f"vllm.gpu_memory_gb={settings.gpu_memory_gb} is invalid: allowed is GiB per GPU > 0, or null "
                         "(read from the GPUs)")  # fmt: skip
    defaults = VllmGpuConfig()
    changed = [item.name for item in fields(VllmGpuConfig) if settings[item.name] != getattr(defaults, item.name)]
    if changed and cfg.backend != VllmBackend.name:
        named = ", ".join(f"vllm.{key}={cli_value(settings[key])}" for key in changed)
        unset = " ".join(f"vllm.{key}={cli_value(getattr(defaults, key))}" for key in changed)
        raise ValueError(f"{named} {'is a setting' if len(changed) == 1 else 'are settings'} of backend={VllmBackend.name}: "
                         f"allowed with backend={cfg.backend} {'is' if len(changed) == 1 else 'are'} {unset}")  # fmt: skip


def check_run_config(cfg: Any) -> None:
    """Check every range and name before any model is loaded (ValueError, one line), once the drafter tuning is
    taken back where the backend does not take it (``take_back_tuning``: the one change made to ``cfg``)."""
    take_back_tuning(cfg)
    DecodeSettings(cfg.max_new_tokens, cfg.drafter.gamma)
    spec = method_spec(cfg)
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size={cfg.batch_size} is invalid: allowed is an integer >= 1")
    from mars_bench.backends import check_backend_config

    check_vllm_settings(cfg)
    check_backend_config(cfg, spec)
    if cfg.batch_size > 1 and own_engine(cfg.backend):  # this package's batched engine
        from mars_bench.drafting.batched import check_batch_drafter

        check_batch_drafter(cfg.drafter.name)
        check_batch_settings(cfg)
    check_tree_judges(cfg.drafter.name, shadow_verifiers(cfg))
    check_accuracy_mode(cfg)
    if cfg.drafter.name == "eagle3" and not cfg.model.eagle3_head:
        raise ValueError(f"drafter=eagle3 needs model.eagle3_head (a folder or Hub id): model={cfg.model.name} sets none")
    parse_dtype(cfg.model.dtype)
    check_kernels(cfg.model.kernels)
    check_memory_budget(cfg.model.device_map, cfg.model.max_memory)
    if drafter_needs_model(cfg.drafter.name) and not cfg.model.draft_model:
        raise ValueError(
            f"drafter={cfg.drafter.name} needs model.draft_model, which model={cfg.model.name} does not set: "
            f"use a drafter without one ({drafters_without_model()})"
        )
    if cfg.task.num_prompts is not None and cfg.task.num_prompts < 1:
        raise ValueError(f"task.num_prompts={cfg.task.num_prompts} is invalid: allowed is an integer >= 1 or null (all)")
    from mars_bench.tasks import SCORERS
    from mars_bench.tasks.prompting import check_prompting
    from mars_bench.tasks.providers import check_task

    check_task(cfg.task)
    check_prompting(cfg.task)

    if cfg.task.scorer is not None and cfg.task.scorer not in (*SCORERS, "judge"):
        raise ValueError(f"task.scorer={cfg.task.scorer!r} is invalid: allowed are {', '.join(sorted(SCORERS))}, judge or null")
    if cfg.task.scorer == "judge" and not cfg.task.judge_model:
        raise ValueError("task.scorer=judge needs task.judge_model=<Hub id or folder of the judge model>")
    if cfg.warmup < 0:
        raise ValueError(f"warmup={cfg.warmup} is invalid: allowed is an integer >= 0")
    if cfg.retry_disturbed < 0:
        raise ValueError(f"retry_disturbed={cfg.retry_disturbed} is invalid: allowed is an integer >= 0")
    if not cfg.disturbed_load > 0:
        raise ValueError(f"disturbed_load={cfg.disturbed_load} is invalid: allowed is a number of cores > 0")
    if not 0 < cfg.disturbed_gpu_util <= 100:
        raise ValueError(f"disturbed_gpu_util={cfg.disturbed_gpu_util} is invalid: allowed is a percent in (0, 100]")
