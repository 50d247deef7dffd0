"""Sweeps on a cluster through Hydra's submitit launcher: every model config sizes its SLURM jobs
(shown as the sbatch script submitit would submit, no SLURM needed), and a sweep whose cells run
as parallel jobs sharing one baseline cache (``submitit_local``) decodes each baseline once, writes
every row once, gives the analysis of a serial sweep, and resumes after one of its jobs is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from functools import partial
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY, app, figures_not_rendered, run_main, sbatch_script, slurm_config

from mars_bench.__main__ import CONF_DIR
from mars_bench.bench.baseline_cache import cache_entries
from mars_bench.bench.cell import CELL_CLAIM
from mars_bench.bench.records import read_rows
from mars_bench.config.overrides import check_slurm_sweep

MODELS = sorted(path.stem for path in (Path(CONF_DIR) / "model").glob("*.yaml"))
# Two cells of one task, so that both jobs, running at once, want the same two baselines. One torch thread
# per job: the two jobs share the two cores without oversubscribing them.
SWEEP = ["experiment=smoke", "task.num_prompts=2", "max_new_tokens=12", "warmup=0", "progress=false", "threads=1",
         "task=gsm8k", "verifier=exact,mars"]  # fmt: skip
PARALLEL = ["hydra/launcher=submitit_local", "hydra.sweeper.max_batch_size=2"]  # two cells (jobs) at a time


@pytest.mark.parametrize("model", MODELS)
def test_the_slurm_launcher_sizes_every_models_jobs_from_its_config(model, tmp_path, monkeypatch):
    cfg = slurm_config(tmp_path, f"model={model}")
    resources = cfg.model.resources
    script = sbatch_script(cfg, monkeypatch)
    assert f"#SBATCH --cpus-per-task={resources.cpus}\n" in script
    assert f"#SBATCH --mem={resources.mem_gb}GB\n" in script and f"#SBATCH --time={resources.timeout_min}\n" in script
    if resources.gpus is None:
        assert "--gpus-per-node" not in script  # a CPU job
    else:
        assert f"#SBATCH --gpus-per-node={resources.gpus}\n" in script
    assert f"#SBATCH --output={tmp_path}/.submitit/" in script


@pytest.mark.slow
def test_the_big_targets_get_enough_gpus_for_their_bf16_weights():
    gpus = {model: slurm_config(Path("/tmp/unused"), f"model={model}").model.resources.gpus for model in MODELS}
    assert gpus["llama3.1-8b"] == 1 and gpus["llama3.3-70b"] >= 2 and gpus["qwen3-235b-a22b"] >= 6


def test_resources_and_slurm_settings_are_overridden_on_the_command_line(tmp_path, monkeypatch):
    cfg = slurm_config(tmp_path, "model=llama3.3-70b", "model.resources.gpus=2", "hydra.launcher.partition=h200")
    script = sbatch_script(cfg, monkeypatch)
    assert "#SBATCH --gpus-per-node=2\n" in script and "#SBATCH --partition=h200\n" in script


@pytest.mark.parametrize("sweep", ["model=llama3.1-8b,qwen3-32b", "model=glob(*)", "model.resources.gpus=2,4"])
def test_a_slurm_sweep_over_what_sizes_its_jobs_is_refused_in_one_line(sweep):
    with pytest.raises(ValueError, match=f"^{re.escape(sweep)} under hydra/launcher=slurm: .* one value of model"):
        check_slurm_sweep(["-m", "hydra/launcher=slurm", sweep, "task=humaneval,gsm8k"])


@pytest.mark.parametrize("overrides", [
    ["-m", "hydra/launcher=slurm", "model=qwen3-32b", "task=humaneval,gsm8k", "verifier.theta=0.5,0.9"],
    ["-m", "hydra/launcher=submitit_local", "model=smollm2-135m,qwen2.5-coder-1.5b"],
])  # fmt: skip
def test_one_target_per_slurm_sweep_and_any_sweep_on_other_launchers_pass(overrides):
    check_slurm_sweep(overrides)


def test_the_app_refuses_a_slurm_sweep_over_targets_before_submitting_anything(tmp_path):
    done = app("-m", "hydra/launcher=slurm", "model=llama3.1-8b,qwen3-32b", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert done.returncode == 2 and done.stderr.startswith("mars_bench: error: model=llama3.1-8b,qwen3-32b under")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "sweep").exists()


def rows_by_cell(sweep: Path) -> dict[str, list[dict]]:
    return {path.parent.name: list(read_rows(path)) for path in sorted(sweep.glob("*/records.jsonl"))}


def deterministic(table: pd.DataFrame) -> pd.DataFrame:
    """A table without its timing columns: seconds differ between any two runs, and which rows count as timed
    (so whether a latency is NaN) depends on what else used the machine then."""
    timed = [column for column in table
             if "speedup" in column or column.startswith(("tok_per_s", "latency_")) or column == "disturbed"]  # fmt: skip
    return table.drop(columns=timed)


@pytest.mark.slow
def test_a_sweep_as_parallel_jobs_decodes_each_baseline_once_and_matches_the_serial_sweep(tmp_path, processes, tiny_target):
    """On the tiny target (conftest.tiny_target): what is shared and written does not depend on the model."""
    parallel, serial = tmp_path / "parallel", tmp_path / "serial"
    cache = "baseline_cache=${hydra:sweep.dir}/baselines"
    done = processes.fork_app("-m", *SWEEP, *TINY, *PARALLEL, f"hydra.sweep.dir={parallel}", cache)
    assert done.returncode == 0, done.stderr[-3000:]
    cells = rows_by_cell(parallel)
    assert len(cells) == 2
    for rows in cells.values():
        keys = [(row["question_id"], row["turn"], row["method"]) for row in rows]
        assert len(keys) == len(set(keys)) == 4  # 2 prompts x (baseline, method), each once
    decoded = [row for rows in cells.values() for row in rows if row["method"] == "baseline" and not row["baseline_from"]]
    assert len(decoded) == len(cache_entries(parallel / "baselines")) == 2  # 2 prompts, each decoded once by one of the jobs
    assert app("-m", *SWEEP, *TINY, f"hydra.sweep.dir={serial}", cache).returncode == 0
    for folder in (parallel, serial):
        assert app_process_analysis(folder) == 0
    for table in ("settings.csv", "fidelity.csv", "quality.csv"):
        if (serial / "analysis" / table).exists():
            pd.testing.assert_frame_equal(deterministic(pd.read_csv(parallel / "analysis" / table)),
                                          deterministic(pd.read_csv(serial / "analysis" / table)))  # fmt: skip


def app_process_analysis(folder: Path) -> int:
    """``python -m analysis FOLDER`` into FOLDER/analysis, its figures drawn but not rendered (only its tables are read)."""
    from analysis.__main__ import main

    with figures_not_rendered():
        return main([str(folder), "--out", str(folder / "analysis")])


def sweep_that_gives_up_at_once_on_a_dead_job(*overrides: str) -> int:
    """``python -m mars_bench OVERRIDES...`` (``run_main``), for a forked child: submitit waits up to 15 s for
    the result file of a job that has ended (for shared filesystems slow to show it), which a killed job never
    writes; on one machine's disk a finished job's file is there before its process ends (submitit's own tests
    wait no second)."""
    import submitit.core.core

    submitit.core.core.Job._results_timeout_s = 0
    return run_main("mars_bench", *overrides)


@pytest.mark.slow
def test_a_killed_job_is_resumed_by_running_the_sweep_again_with_nothing_lost_or_twice(tmp_path, processes, tiny_target):
    """On the tiny target (conftest.tiny_target): resuming does not depend on the model. The kill is triggered
    by the first row on disk; a cell's other rows need at least three more decodes of 64 tokens (its baselines
    may come from the other job's), so it lands mid-cell."""
    sweep = tmp_path / "sweep"
    overrides = ["-m", *SWEEP, *TINY, "task.num_prompts=3", "max_new_tokens=64",
                 *PARALLEL, f"hydra.sweep.dir={sweep}", "baseline_cache=${hydra:sweep.dir}/baselines"]  # fmt: skip
    first = processes.start_fork(partial(sweep_that_gives_up_at_once_on_a_dead_job, *overrides), cwd=tmp_path)
    victim = None
    deadline = time.monotonic() + 240
    while victim is None and time.monotonic() < deadline:  # the first cell with a row written: kill its job mid-cell
        for claim in sweep.glob(f"*/{CELL_CLAIM}"):
            records = claim.parent / "records.jsonl"
            if records.exists() and records.read_text().count("\n") >= 1:
                victim = json.loads(claim.read_text())["pid"]
                os.kill(victim, signal.SIGKILL)
                break
        time.sleep(0.05)
    assert victim is not None, "no cell started writing"
    assert first.wait(timeout=300).returncode != 0  # the sweep saw its job die
    before = sum(len(rows) for rows in rows_by_cell(sweep).values())
    again = processes.fork_app(*overrides, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    cells = rows_by_cell(sweep)
    assert len(cells) == 2 and before < 2 * 6
    for rows in cells.values():
        keys = [(row["question_id"], row["turn"], row["method"]) for row in rows]
        assert len(keys) == len(set(keys)) == 6 and all(row["status"] == "ok" for row in rows)
    assert len(cache_entries(sweep / "baselines")) == 3 and not list(sweep.rglob("*.claim"))
