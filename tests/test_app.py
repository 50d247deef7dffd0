"""The Hydra app: every config option composes; bad input fails with one clear line;
a killed run resumes without lost or duplicated rows; a multirun gives one cell per value."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mars_bench.__main__ import CONF_DIR
from mars_bench.bench.manifest import source_hash
from mars_bench.bench.records import Record, read_rows
from mars_bench.config import DRAFTER_PARAMS, check_run_config, drafter_setting, max_draft_depth

GROUPS = {
    group: sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
    for group in ("model", "drafter", "verifier", "task", "experiment")
}
FAST = ["experiment=smoke", "task.num_prompts=2", "max_new_tokens=12", "warmup=0", "progress=false"]


WORKDIR = tempfile.mkdtemp(prefix="mars_bench_app_")  # Hydra's own run folders land here, not in the repository


def app(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "mars_bench", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=WORKDIR)


@pytest.mark.parametrize(("group", "option"), [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if group == "model" and option == "smollm2-135m":
        overrides.append("drafter=layerskip")  # it has no separate draft model
    if group == "drafter" and option == "eagle3":
        overrides.append("model=llama3.1-8b")  # a target with a published EAGLE-3 head
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    check_run_config(cfg)
    if group != "experiment":
        assert cfg[group].name == option


def test_records_name_the_keys_that_shape_each_shipped_drafter():
    assert set(GROUPS["drafter"]) <= set(DRAFTER_PARAMS)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        tree = compose(config_name="config", overrides=["drafter=model_tree"])
        chain = compose(config_name="config", overrides=["drafter=model", "drafter.length=schedule", "drafter.max_gamma=9"])
    assert drafter_setting(tree.drafter) == "gamma=5,top_k=3,tree_tokens=16"
    assert drafter_setting(chain.drafter) == "gamma=5"  # the draft-length policy is a setting column of its own
    assert (max_draft_depth(chain.drafter), max_draft_depth(tree.drafter)) == (9, 15)  # a tree: its node budget


def test_the_shipped_groups_cover_the_paper():
    assert {
        "qwen2.5-coder-1.5b",
        "smollm2-135m",
        "llama3.1-8b",
        "llama3.3-70b",
        "vicuna-13b",
        "qwen3-8b",
        "qwen3-32b",
        "qwen3-235b-a22b",
    } <= set(GROUPS["model"])
    assert {"exact", "rejection", "mars", "mars_ref", "typical"} <= set(GROUPS["verifier"])
    assert {"mt_bench", "humaneval", "gsm8k", "alpaca", "cnndm", "qa", "wmt19", "aime2025"} <= set(GROUPS["task"])
    assert {"model", "layerskip", "lookup", "none"} <= set(GROUPS["drafter"])
    assert {"smoke", "default", "paper"} <= set(GROUPS["experiment"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["verifier=strict"], "Could not find 'verifier/strict'"),
        (["max_new_tokens=many"], "max_new_tokens"),
        (["max_new_tokn=5"], "Could not override 'max_new_tokn'"),
        (["verifier.theta=1.5"], "theta=1.5 is invalid"),
        (["temperature=-1"], "temperature=-1.0 is invalid"),
        (["top_p=0"], "top_p=0.0 is invalid"),
        (["model=smollm2-135m"], "drafter=model needs model.draft_model"),
        (["drafter.length=wild"], "drafter.length='wild' is invalid: allowed are fixed, schedule, confidence"),
        (["shadow=[strict]"], "shadow verifier 'strict' is unknown: allowed are exact, rejection"),
        (["output_dir=/proc/mars_bench_out"], "output folder '/proc/mars_bench_out' cannot be written"),
    ],
)
def test_bad_input_fails_at_start_with_one_clear_line(overrides, message):
    result = app(*overrides, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_malformed_prompt_file_names_file_and_line(tmp_path):
    bad = tmp_path / "questions.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2, "turns": ["oops"\n')
    result = app(*FAST, f"task.file={bad}", f"output_dir={tmp_path / 'out'}", timeout=120)
    assert result.returncode == 2
    assert f"{bad}:2: bad JSON" in result.stderr


def test_smoke_writes_records_manifest_config_and_summary(tmp_path):
    out = tmp_path / "run"
    result = app(*FAST, f"output_dir={out}")
    assert result.returncode == 0, result.stderr
    assert "| baseline |" in result.stdout and "| mars |" in result.stdout
    rows = list(read_rows(out / "records.jsonl"))
    assert len(rows) == 4  # 2 prompts x (baseline, mars)
    assert set(rows[0]) == {f.name for f in fields(Record)}
    for row in rows:
        assert row["new_tokens"] == len(row["output_ids"]) <= 12
        assert row["tau"] > 0 and row["decode_s"] > 0 and row["prefill_s"] > 0
        assert row["verified_positions"] == len(row["margins"]) == len(row["reasons"])
    baseline = next(r for r in rows if r["method"] == "baseline")
    assert baseline["tau"] == 1.0 and baseline["agreement"] is None
    # the method ran first on the second question, yet every method row is compared with its baseline
    assert all(0 <= r["agreement"] <= 1 and 0 <= r["baseline_rouge_l"] <= 1 for r in rows if r["method"] == "mars")
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"packages", "git", "source_sha256", "cpu", "models", "seeds", "config"} <= set(manifest)
    assert manifest["models"]["target"]["dtype"] == "bfloat16"
    assert manifest["methods"]["mars"]["verifier"] == {"name": "mars", "theta": 0.9, "guard": "never", "correction": "residual"}
    assert manifest["methods"]["mars"]["drafter"]["name"] == "layerskip" and manifest["methods"]["baseline"]["drafter"] is None
    assert (out / "summary.csv").read_text().startswith("cell,method")
    assert "max_new_tokens: 12" in (out / "config.yaml").read_text()


def test_the_source_hash_names_the_code_and_configs_that_ran(tmp_path):
    for name, text in {"mars_bench/a.py": "x = 1", "conf/b.yaml": "k: 1", "mars_bench/notes.txt": "n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    before = source_hash(tmp_path)
    (tmp_path / "mars_bench/notes.txt").write_text("other")  # neither code nor config
    assert source_hash(tmp_path) == before
    (tmp_path / "conf/b.yaml").write_text("k: 2")
    assert source_hash(tmp_path) != before
    assert source_hash() == source_hash()  # this checkout's, stable


def test_a_tree_drafter_with_a_separate_model_runs_a_cell_losslessly(tmp_path):
    out = tmp_path / "tree"
    smol = "HuggingFaceTB/SmolLM2-135M-Instruct"
    result = app(*FAST, "drafter=model_tree", f"model.draft_model={smol}", "temperature=0", "verifier=exact",
                 "model.dtype=float32", f"output_dir={out}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = list(read_rows(out / "records.jsonl"))
    assert [row["status"] for row in rows] == ["ok"] * 4
    assert all(row["agreement"] == 1.0 and row["tau"] > 1 for row in rows if row["method"] == "exact")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["methods"]["exact"]["drafter"] == {"name": "model_tree", "top_k": 3, "tree_tokens": 16}


def test_a_killed_run_resumes_without_lost_or_duplicated_rows(tmp_path):
    out = tmp_path / "run"
    records = out / "records.jsonl"
    overrides = [*FAST, "task.num_prompts=4", f"output_dir={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mars_bench", *overrides],
        env=env,
        cwd=WORKDIR,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline and (not records.exists() or len(records.read_text().splitlines()) < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = len(list(read_rows(records)))
    assert 3 <= killed_at < 8
    result = app(*overrides)
    assert result.returncode == 0, result.stderr
    keys = [(r["question_id"], r["turn"], r["method"]) for r in read_rows(records)]
    assert len(keys) == len(set(keys)) == 8


def test_a_multirun_gives_one_cell_per_threshold_sharing_one_baseline(tmp_path):
    sweep = [f"hydra.sweep.dir={tmp_path}", "baseline_cache=${hydra:sweep.dir}/baselines", "shadow=[rejection]"]
    result = app("-m", *FAST, "task.num_prompts=1", "verifier.theta=0.5,0.9", *sweep)
    assert result.returncode == 0, result.stderr
    cells = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name != "baselines")
    assert [c.name for c in cells] == ["0_humaneval_mars_theta0.5_t1.0", "1_humaneval_mars_theta0.9_t1.0"]
    rows = {}
    for cell, theta in zip(cells, (0.5, 0.9)):
        rows[theta] = {r["method"]: r for r in read_rows(cell / "records.jsonl")}
        assert set(rows[theta]) == {"baseline", "mars"}
        assert all(r["theta"] == theta for r in rows[theta].values())
        mars = rows[theta]["mars"]
        assert list(mars["shadow_accepted"]) == ["rejection"]
        assert len(mars["shadow_accepted"]["rejection"]) == len(mars["step_accepted"])
    first, second = rows[0.5]["baseline"], rows[0.9]["baseline"]
    assert first["baseline_from"] is None  # decoded here ...
    assert second["baseline_from"] == first["cell"]  # ... and copied, not decoded again, by the second cell
    assert (second["output_ids"], second["decode_s"]) == (first["output_ids"], first["decode_s"])
    assert rows[0.9]["mars"]["agreement"] is not None
