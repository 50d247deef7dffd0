"""Every command the README and the docs pages show runs, as a user types it, in the order a user runs them.

The commands are read from the shell code blocks of README.md and docs/*.md, so a shown command that
breaks fails here. Each runs through its real entry point (``python -m X`` is ``runpy`` on X with the same
argv; ``mars-bench-lm-eval`` is the console script's function), in one process so that the
small model loads once. What differs from the user's command is only the model (SmolLM2-135M,
drafting for itself where the command uses a separate draft model), the prompt count and the
token budget, appended as overrides; commands for 8B-235B targets are composed and checked,
not run. The first Quick start command's last step is the README's main command, run here;
the second is the command CI runs (checked below).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA, needs_shared_data, python_m
from hydra import compose, initialize_config_dir

from mars_bench.bench.records import read_rows
from mars_bench.config import check_run_config
from mars_bench.paths import CONF_DIR
from mars_bench.perf.__main__ import parse as perf_options

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMALL = ["task.num_prompts=2", "max_new_tokens=8", "warmup=0", "progress=false"]
SMALL_MODEL = ["model=smollm2-135m", f"model.draft_model={SMOLLM}"]
LARGE = re.compile(r"model=(llama|qwen3|vicuna)|drafter=eagle3|experiment=table1")

pytestmark = pytest.mark.slow


def readme_commands() -> list[str]:
    """The shell commands in the shell code blocks of the README and the docs pages: continuation
    lines joined, comments cut."""
    commands, block, pending = [], None, ""
    for line in "\n".join(page.read_text() for page in DOCS).splitlines():
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip()
            continue
        if block != "":  # outside a block, or a block in another language (python)
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        command = re.sub(r"\s+#.*$", "", pending).strip()
        pending = ""
        if re.match(r"(python3? |mars-bench|[A-Z_]+=)", command):  # not a folder listing or other text
            commands.append(command)
    return commands


def readme(prefix: str) -> str:
    """The one README command that starts with ``prefix`` (the README is the source of the text run)."""
    found = [command for command in readme_commands() if command.startswith(prefix)]
    assert len(found) == 1, f"the README shows {len(found)} commands starting with {prefix!r}"
    return found[0]


def run(command: str, cwd: Path, monkeypatch, extra: list[str] = (), replace: dict[str, str] | None = None) -> int:
    """Run a README command through its entry point in this process; its exit status."""
    for placeholder, value in (replace or {}).items():
        command = command.replace(placeholder, value)
    words = shlex.split(command)
    while "=" in words[0]:  # VAR=value prefixes
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    if words[0] == "mars-bench-lm-eval":  # the console script is this function
        from mars_bench.lm_eval_model import cli

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


def app_overrides(command: str) -> list[str]:
    """The small model (unless the command's experiment picks it) and the small budget."""
    return ([] if "experiment=smoke" in command else SMALL_MODEL) + SMALL


def index_entries(report: Path) -> tuple[set[str], set[str]]:
    """(files the analysis made, what it skipped), from its index.md."""
    made, skipped = set(), set()
    for line in (report / "index.md").read_text().splitlines():
        made |= set(re.findall(r"\]\(([^)]+)\)", line))
        if ": skipped," in line:
            skipped.add(line[2 : line.index(": skipped,")])
    return made, skipped


MAIN = "python -m mars_bench"  # the embedded default: the README shows it alone


def test_run_then_analyse_then_rescore(tmp_path, monkeypatch):
    assert MAIN in readme_commands()
    assert run(MAIN, tmp_path, monkeypatch, app_overrides(MAIN)) == 0
    records = next((tmp_path / "runs").rglob("records.jsonl"))
    assert len(list(read_rows(records))) == 4  # 2 prompts x (baseline, mars)

    assert run(readme("python -m analysis runs"), tmp_path, monkeypatch) == 0
    report = tmp_path / readme("python -m analysis runs").split("--out ")[1]
    made, skipped = index_entries(report)
    assert {"records.parquet", "settings.md", "table1.md", "table1.tex", "quality.md", "pareto.png", "alpha_per_depth.png",
            "margin_histograms.png", "acceptance_by_margin.png"} <= made  # fmt: skip
    assert skipped == {"threshold ablation", "shadow", "fidelity"}  # one theta; no shadow verifiers; fidelity off
    assert "/tmp" not in (report / "index.md").read_text()  # it names no folder of this machine

    assert run(readme("python -m mars_bench.bench.rescore"), tmp_path, monkeypatch) == 0
    assert all(row["score"] is not None for row in read_rows(records))


def test_the_smoke_command(smoke_run):
    assert readme("python -m mars_bench experiment=smoke") == "python -m mars_bench experiment=smoke"
    result, out = smoke_run  # run once for the session with 2 prompts, 12 new tokens (conftest.SMOKE)
    assert result.returncode == 0, result.stderr
    rows = list(read_rows(out / "records.jsonl"))
    assert len(rows) == 4 and all(row["status"] == "ok" for row in rows)


@pytest.mark.parametrize(
    "prefix",
    [
        "python -m mars_bench verifier=rejection",
        "python -m mars_bench temperature=0 verifier=exact drafter=lookup",
        "python -m mars_bench drafter=model_tree",
    ],
)
def test_each_single_run_command(prefix, tmp_path, monkeypatch):
    command = readme(prefix)
    assert run(command, tmp_path, monkeypatch, app_overrides(command)) == 0
    rows = list(read_rows(next((tmp_path / "runs").rglob("records.jsonl"))))
    assert len(rows) == 4 and all(row["status"] == "ok" for row in rows)


def test_a_threshold_sweep_then_its_analysis(tmp_path, monkeypatch):
    sweep = readme("python -m mars_bench -m verifier=mars")
    assert run(sweep, tmp_path, monkeypatch, [*app_overrides(sweep), "task.num_prompts=1"]) == 0
    cells = sorted(path.parent for path in (tmp_path / "SWEEP").rglob("records.jsonl"))  # the README's hydra.sweep.dir
    thetas = (0.84, 0.88, 0.9, 0.94, 0.98)
    assert [cell.name for cell in cells] == [f"{i}_humaneval_mars_theta{theta}_t1.0" for i, theta in enumerate(thetas)]
    for cell, theta in zip(cells, thetas):
        rows = list(read_rows(cell / "records.jsonl"))
        assert sorted(r["method"] for r in rows) == ["baseline", "mars"] and {r["theta"] for r in rows} == {theta}
    analyse = readme("python -m analysis SWEEP")
    assert run(analyse, tmp_path, monkeypatch) == 0
    made, skipped = index_entries(tmp_path / analyse.split("--out ")[1])
    assert {"settings.md", "table1.md", "threshold_ablation.png", "pareto.png", "quality.md"} <= made
    assert skipped == {"shadow", "fidelity"}


def test_the_papers_threshold_ablation_then_its_analysis(tmp_path, monkeypatch):
    strict = readme("python -m mars_bench -m experiment=threshold_ablation verifier=rejection")
    sweep = readme("python -m mars_bench -m experiment=threshold_ablation hydra.sweep.dir=DIR")
    for command in (strict, sweep):
        assert run(command, tmp_path, monkeypatch, [*app_overrides(command), "task.num_prompts=1"]) == 0
    cells = sorted(path.parent for path in (tmp_path / "DIR").rglob("records.jsonl") if path.parent.name != "baselines")
    assert len(cells) == 2 + 10  # strict x 2 tasks, then 5 thetas x 2 tasks
    baselines = {}
    for cell in cells:
        rows = {row["method"]: row for row in read_rows(cell / "records.jsonl")}
        method = rows["rejection" if "rejection" in cell.name else "mars"]
        theta = method["theta"] or 0.9  # shadows take the cell's verifier.theta (0.9 in the strict command)
        assert list(method["shadow_accepted"]) == ["rejection", f"mars(theta={theta},guard=never,correction=residual)"]
        assert all(len(kept) == len(method["step_accepted"]) for kept in method["shadow_accepted"].values())
        baselines.setdefault(rows["baseline"]["task"], []).append(rows["baseline"])
    for task, rows in baselines.items():  # each task's baseline decoded once, by the first cell, then copied
        assert [row["baseline_from"] is None for row in rows].count(True) == 1, task
        assert len({(tuple(row["output_ids"]), row["decode_s"]) for row in rows}) == 1, task
    analyse = readme("python -m analysis DIR --out")
    assert run(analyse, tmp_path, monkeypatch) == 0
    made, skipped = index_entries(tmp_path / analyse.split("--out ")[1])
    assert {"threshold_ablation.png", "shadow.md", "quality.md", "table1.tex"} <= made and skipped == {"fidelity"}


def fidelity_of(row: dict) -> dict[str, dict]:
    assert row["fidelity"], "the method row carries no fidelity"
    for label, cost in row["fidelity"].items():  # alpha_V <= 1 - TV(q, p) + TV(P_V, p), summed
        if cost["draft_tv"] is not None:
            assert cost["accept"] <= cost["positions"] - cost["draft_tv"] + cost["tv"] + 1e-6, label
    return row["fidelity"]


def test_the_zoo_then_its_frontier(tmp_path, monkeypatch):
    zoo = readme("python -m mars_bench -m experiment=zoo")
    assert run(zoo, tmp_path, monkeypatch, [*app_overrides(zoo), "task.num_prompts=1"]) == 0
    cells = sorted(path.parent for path in (tmp_path / "ZOO").rglob("records.jsonl") if path.parent.name != "baselines")
    assert [cell.name.split("_")[1] for cell in cells] == ["humaneval", "gsm8k", "mt"]
    for cell in cells:
        (method,) = [row for row in read_rows(cell / "records.jsonl") if row["method"] == "rejection"]
        costs = fidelity_of(method)
        assert list(costs)[0] == "rejection" and len(costs) == 21 and method["turn"] == 1
        assert costs["rejection"]["kl"] < 1e-6 and costs["rejection"]["tv"] < 1e-5
    analyse = readme("python -m analysis ZOO")
    assert run(analyse, tmp_path, monkeypatch) == 0
    made, _ = index_entries(tmp_path / analyse.split("--out ")[1])
    assert {"frontier.png", "fidelity.md", "fidelity.csv", "shadow.md"} <= made


def test_the_decomposition_then_its_table(tmp_path, monkeypatch):
    steps = readme("python -m mars_bench -m experiment=decomposition")
    assert run(steps, tmp_path, monkeypatch, [*app_overrides(steps), "task.num_prompts=1"]) == 0
    cells = sorted((path.parent for path in (tmp_path / "DECOMP").rglob("records.jsonl") if path.parent.name != "baselines"),
                   key=lambda cell: int(cell.name.split("_")[0]))  # fmt: skip
    methods = [(row["verifier"], row["theta"]) for cell in cells for row in read_rows(cell / "records.jsonl")
               if row["method"] != "baseline"]  # fmt: skip
    assert methods[::3] == [("rejection", None), ("mars_ref", None), ("mars", 0.9), ("mars_ref", 0.9)]
    for cell in cells:
        rows = {row["method"]: row for row in read_rows(cell / "records.jsonl")}
        (method,) = [row for name, row in rows.items() if name != "baseline"]
        assert method["drafter"] == "model_tree" and len(fidelity_of(method)) == 1
    analyse = readme("python -m analysis DECOMP")
    assert run(analyse, tmp_path, monkeypatch) == 0
    made, _ = index_entries(tmp_path / analyse.split("--out ")[1])
    assert {"decomposition.md", "decomposition.csv", "fidelity.md"} <= made


def test_a_single_run_with_fidelity(tmp_path, monkeypatch):
    command = readme("python -m mars_bench fidelity=true")
    assert run(command, tmp_path, monkeypatch, app_overrides(command)) == 0
    rows = list(read_rows(next((tmp_path / "runs").rglob("records.jsonl"))))
    for row in (row for row in rows if row["method"] == "mars"):
        costs = fidelity_of(row)
        assert list(costs) == ["mars(theta=0.9,guard=never,correction=residual)", "rejection"]
        assert len(row["position_kl"]) == len(row["margins"]) == costs[next(iter(costs))]["judged"]


@pytest.mark.parametrize("prefix", ["python -m mars_bench -m experiment=table1", "python -m mars_bench model=llama3.1-8b",
                                    "python -m mars_bench model=qwen3-32b"])  # fmt: skip
def test_large_target_commands_compose_and_pass_every_check(prefix):
    words = shlex.split(readme(prefix))[3:]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[word for word in words if word != "-m"])
    check_run_config(cfg)
    assert LARGE.search(readme(prefix))


CLUSTER_SWEEP = "python -m mars_bench -m hydra/launcher=slurm"


def paper_targets() -> list[str]:
    """The models the cluster recipe (docs/clusters.md) loops over."""
    return re.search(r"for model in ([^;]+); do", (REPO / "docs" / "clusters.md").read_text()).group(1).split()


def test_the_cluster_recipe_covers_the_papers_six_targets_and_sizes_each_ones_jobs(tmp_path, monkeypatch):
    from test_cluster import sbatch_script, slurm_config

    assert paper_targets() == ["vicuna-13b", "llama3.1-8b", "llama3.3-70b", "qwen3-8b", "qwen3-32b", "qwen3-235b-a22b"]
    for model in paper_targets():
        words = shlex.split(readme(CLUSTER_SWEEP).replace("$model", model).removesuffix("&"))[3:]
        overrides = [w for w in words if w not in ("-m", "hydra/launcher=slurm") and not w.startswith("hydra.sweep.dir=")]
        cfg = slurm_config(tmp_path / model, *overrides)
        check_run_config(cfg)
        assert LARGE.search(" ".join(words)) and cfg.model.name == model and cfg.drafter.name == "eagle3"
        assert f"#SBATCH --gpus-per-node={cfg.model.resources.gpus}\n" in sbatch_script(cfg, monkeypatch)


@needs_shared_data  # Alpaca and CNN/DM prompts come from ../shared/data (or the Hub)
def test_the_cluster_recipe_then_its_table1(tmp_path, monkeypatch):
    """The recipe's sweep for one target (SmolLM2 drafting for itself, in this process rather than on
    SLURM, one prompt per task), then the recipe's analysis over the folder of every sweep."""
    sweep = readme(CLUSTER_SWEEP).replace("$model", "smollm2-135m").removesuffix("&")
    sweep = sweep.replace("hydra/launcher=slurm ", "").replace("drafter=eagle3", "drafter=model")
    assert run(sweep, tmp_path, monkeypatch, [f"model.draft_model={SMOLLM}", *SMALL, "task.num_prompts=1"]) == 0
    assert len(list((tmp_path / "table1" / "smollm2-135m").glob("*/records.jsonl"))) == 10  # 5 tasks x 2 verifiers
    analyse = readme("python -m analysis table1")
    assert run(analyse, tmp_path, monkeypatch) == 0
    table = (tmp_path / "table1" / "analysis" / "table1.md").read_text()
    assert all(task in table for task in ("mt_bench", "humaneval", "gsm8k", "alpaca", "cnndm"))


@needs_shared_data  # its task file reads ../shared/data/gsm8k/question.jsonl, as the README says
def test_the_lm_eval_example_from_the_repository(monkeypatch, capsys):
    command = readme("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 mars-bench-lm-eval")
    assert "--limit 5" in command
    assert run(command, REPO, monkeypatch, ["--gen_kwargs", "max_gen_toks=16"], {"--limit 5": "--limit 1"}) == 0
    output = capsys.readouterr().out
    assert "|gsm8k_local|" in output and "exact_match" in output


PERF_SMALL = ["--model", "smollm2-135m", "--draft-model", SMOLLM, "--num-prompts", "2", "--max-new-tokens", "8",
              "--data-dir", str(SHARED_DATA)]  # fmt: skip


def test_the_perf_suite_on_two_prompts_compares_every_method_with_transformers(tmp_path, monkeypatch, capsys):
    command = readme("python -m mars_bench.perf --repeats 2")
    assert run(command, tmp_path, monkeypatch, [*PERF_SMALL, "--tasks", "gsm8k"]) == 0
    out = tmp_path / "perf_out"
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
        assert len(row["ratios"]) == 2 and row["min"] <= row["median"] <= row["max"]
        assert row["prompt_min"] <= row["prompt_median"] <= row["prompt_max"] and row["runs"] == 4
    for row in report["results"].values():
        assert row["runs"] == 4
        if row["side"] == "ours":
            assert 0 < row["outside_forwards_share"] < 1 and abs(sum(row["phase_share"].values()) - 1) < 1e-6
    against_generate = next(row for row in report["comparisons"] if row["against"] == "T=0 transformers generate")
    assert against_generate["identical"] == 4  # our greedy AR decoding is generate's, token for token (SmolLM2, bf16)
    assert report["assisted_generation"]["num_assistant_tokens"] == 20
    assert report["peer_loading"] == "AutoModelForCausalLM.from_pretrained(path, dtype=bfloat16).eval()"
    chains = {"T=0 ours chain exact, fixed", "T=1 ours chain rejection, fixed"}
    assert set(report["analytic"]["speedup_over_our_baseline"]) == chains
    tables = (out / "perf.md").read_text()
    assert "| T=0 ours AR baseline | T=0 transformers generate |" in tables and "| gsm8k " in tables
    capsys.readouterr()
    assert run(readme("python -m mars_bench.perf.report"), tmp_path, monkeypatch) == 0
    assert capsys.readouterr().out.startswith(tables)  # the same tables again, from perf.json alone


@pytest.mark.parametrize(("prefix", "tasks"), [("python -m mars_bench.perf --draft-length", ["--tasks", "gsm8k"]),
                                               ("python -m mars_bench.perf --tasks mt_bench --draft-length", [])])  # fmt: skip
def test_the_drafter_configurations_run_each_length_policy_with_each_draft_vocabulary(prefix, tasks, tmp_path, monkeypatch):
    command = readme(prefix)
    counts = tmp_path / "counts.npy"
    np.save(counts, np.arange(49152)[::-1])  # a user's count file: here the lowest ids are the most frequent
    small = [*PERF_SMALL, *tasks, "--num-prompts", "1", "--token-counts", str(counts), "--repeats", "1"]
    assert run(command, tmp_path, monkeypatch, small) == 0
    out = next(path for path in tmp_path.iterdir() if (path / "perf.json").is_file())
    report = json.loads((out / "perf.json").read_text())
    lengths, vocabs = report["settings"]["draft_lengths"], report["settings"]["draft_vocabs"]
    assert len(lengths) == 3 and None in vocabs and len(vocabs) == 2
    chains = [row for row in report["results"].values() if row["config"] is not None]
    assert sorted((row["config"]["length"], row["config"]["vocab"] or 0) for row in chains) == sorted(
        (length, vocab or 0) for length in lengths for vocab in vocabs)  # fmt: skip
    assert set(report["analytic"]["speedup_over_our_baseline"]) == {row["method"] for row in chains}
    reduced = [vocab for vocab in report["analytic"]["costs"]["drafter"] if vocab != "None"]
    assert reduced == [str(vocabs[1])]  # one-token drafter forwards measured for the reduced head too


def test_the_temperature_1_run_times_the_configurations_it_names_one_by_one(tmp_path, monkeypatch):
    counts = tmp_path / "counts.npy"
    np.save(counts, np.arange(49152)[::-1])
    small = [*PERF_SMALL, "--tasks", "gsm8k", "--num-prompts", "1", "--token-counts", str(counts), "--repeats", "1"]
    assert run(readme("python -m mars_bench.perf --configs fixed"), tmp_path, monkeypatch, small) == 0
    out = next(path for path in tmp_path.iterdir() if (path / "perf.json").is_file())
    report = json.loads((out / "perf.json").read_text())
    assert set(report["results"]) == {"T=1 ours AR baseline", "T=1 transformers assisted generation",
                                      "T=1 ours chain rejection, fixed", "T=1 ours chain rejection, confidence + vocab 32768"}
    assert set(report["analytic"]["speedup_over_our_baseline"]) == {"T=1 ours chain rejection, fixed",
                                                                    "T=1 ours chain rejection, confidence + vocab 32768"}
    assert "drafter configurations fixed, confidence + vocab 32768, 1 of 1 repeats" in (out / "perf.md").read_text()


GSM8K_ONLY = ["--tasks", "gsm8k"]


@pytest.mark.parametrize(("prefix", "chain", "tasks"), [
    ("python -m mars_bench.perf --configs confidence:32768:int4 --temperatures 0", "T=0 ours chain exact", GSM8K_ONLY),
    ("python -m mars_bench.perf --configs confidence:32768:int4 --temperatures 1", "T=1 ours chain rejection", GSM8K_ONLY),
    ("python -m mars_bench.perf --tasks mt_bench --configs", "T=0 ours chain exact", []),
])  # fmt: skip
def test_the_int4_drafter_runs_time_the_quantized_configuration_at_each_temperature_and_on_mt_bench(
        prefix, chain, tasks, tmp_path, monkeypatch):  # fmt: skip
    counts = tmp_path / "counts.npy"
    np.save(counts, np.arange(49152)[::-1])
    small = [*PERF_SMALL, *tasks, "--num-prompts", "1", "--token-counts", str(counts), "--repeats", "1"]
    assert run(readme(prefix), tmp_path, monkeypatch, small) == 0
    out = next(path for path in tmp_path.iterdir() if (path / "perf.json").is_file())
    report = json.loads((out / "perf.json").read_text())
    chain += ", confidence + vocab 32768 + int4 weights"
    assert chain in report["results"] and set(report["analytic"]["speedup_over_our_baseline"]) == {chain}
    assert list(report["analytic"]["costs"]["drafter"]) == ["32768:int4"]  # the quantized drafter's own forward cost
    assert report["results"][chain]["config"] == {"length": "confidence", "vocab": 32768, "weights": "int4"}
    assert list(report["settings"]["tasks"]) == (tasks[1:] or ["mt_bench"])


def test_the_default_perf_command_differs_only_in_its_repeats():
    settings, out = perf_options(shlex.split(readme("python -m mars_bench.perf --out"))[3:])
    two, _ = perf_options(shlex.split(readme("python -m mars_bench.perf --repeats 2"))[3:])
    assert settings.repeats == 3 and settings == replace(two, repeats=3) and out == Path("perf_out")


def test_every_readme_command_is_run_by_a_test_here():
    """A new README command needs a journey above (the analysis's synopsis line is its usage, and the
    Quick start lines are the main command and CI's)."""
    source = Path(__file__).read_text()
    literals = {prefix.rstrip() for prefix in re.findall(r'"((?:python -m |HF_HUB_OFFLINE)[^"]*)"', source)}
    selectors = literals - {MAIN}
    for command in readme_commands():
        if "pip install" in command or "[DIR ...]" in command or command == MAIN:
            continue
        assert any(command == s or command.startswith(s + " ") for s in selectors), f"no test runs: {command}"


def test_ci_runs_the_readme_test_command():
    quick_start = [command for command in readme_commands() if "pip install" in command]
    assert len(quick_start) == 2 and quick_start[0].endswith("&& python -m mars_bench")
    assert quick_start[1] in (REPO / ".ci" / "run").read_text()


def test_a_misspelt_lm_eval_setting_is_refused_in_one_line_before_any_model_loads():
    from mars_bench.lm_eval_model import MarsBenchLM

    message = ("unknown model_args topk for drafter=model_tree, verifier=mars: their settings are correction, draft_vocab, "
               "entropy_gate, guard, theta, token_counts, top_k, tree_tokens, weights")  # fmt: skip
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        MarsBenchLM(target="no/such-model", drafter="model_tree", verifier="mars", topk=3)
