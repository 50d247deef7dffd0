"""Timings that know when the machine was busy: every timed row records the CPU time other
processes used while it ran (and their GPU use where NVML is), a row beyond the threshold is
flagged, ``retry_disturbed`` times it again once the machine is idle, and the summary and the
analysis leave disturbed rows out of speedups unless told otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pandas as pd
import psutil
import pytest
from conftest import SMOKE, TINY, app

from mars_bench.bench import contention
from mars_bench.bench.contention import Contention, ContentionMeter, GpuWatch, machine_busy_s
from mars_bench.bench.records import read_rows
from mars_bench.bench.summary import disturbed_rows, format_table, summarise
from mars_bench.common import engine_processes

BUSY = "import time\nend = time.time() + {seconds}\nprint('busy', flush=True)\nwhile time.time() < end: pass"


OWN_CPU_S = contention.own_cpu_s  # this process's CPU seconds, as the meter reads them unpatched


class SimulatedMachine:
    """A machine on which other processes keep ``cores`` cores busy, for the first ``intervals``
    intervals a meter measures (then none: a competitor that finishes) or throughout (None). Its
    busy CPU seconds are this process's own, as measured, plus the others' ``cores`` per second.

    The meter reads the machine's busy time, then this process's own (``own_cpu_s``), which answers
    what the busy time just read: two real reads of a counter that moves in clock ticks could differ
    by a tick, which over a tiny model's decode of a few ms would read as another process's load."""

    def __init__(self, cores: float, intervals: int | None = None) -> None:
        self.cores, self.intervals_left = cores, intervals
        self.others_s, self.since = 0.0, time.perf_counter()
        self.own_read = OWN_CPU_S()

    def busy_s(self) -> float:
        now = time.perf_counter()
        self.others_s += self.cores * (now - self.since)
        self.since = now
        self.own_read = OWN_CPU_S()
        return self.own_read + self.others_s

    def own_cpu_s(self) -> float:
        return self.own_read

    def set_cores(self, cores: float) -> None:
        self.busy_s()
        self.cores = cores

    def interval_measured(self) -> None:
        if self.intervals_left is not None:
            self.intervals_left -= 1
            if self.intervals_left <= 0:
                self.set_cores(0.0)


@pytest.fixture
def machine(monkeypatch):
    """``machine(cores, intervals=None)``: every ContentionMeter, the app's among them, measures a
    ``SimulatedMachine`` instead of this one, which other work shares."""

    def simulate(cores: float, intervals: int | None = None) -> SimulatedMachine:
        simulated = SimulatedMachine(cores, intervals)
        stop = ContentionMeter.stop

        def stop_and_count(meter):
            measured = stop(meter)
            simulated.interval_measured()
            return measured

        monkeypatch.setattr(contention, "machine_busy_s", simulated.busy_s)
        monkeypatch.setattr(contention, "own_cpu_s", simulated.own_cpu_s)
        monkeypatch.setattr(ContentionMeter, "stop", stop_and_count)
        return simulated

    return simulate


def test_other_processes_cpu_time_is_the_machines_busy_time_less_this_processes(monkeypatch):
    own = iter([10.0, 10.5])  # this process used 0.5 s of CPU in the interval
    busy = iter([1000.0, 1000.0 + 2.0])  # the machine's cores 2.0 s busy in all
    monkeypatch.setattr(contention, "own_cpu_s", lambda: next(own))
    monkeypatch.setattr(contention, "machine_busy_s", lambda: next(busy))
    meter = ContentionMeter(GpuWatch())
    meter.start()
    measured = meter.stop()
    assert measured.other_cpu_s == pytest.approx(2.0 - 0.5)
    assert measured.to_record()["other_gpu_util"] is None


def test_the_machines_busy_time_is_psutils_busy_fields_and_includes_this_processes():
    times = SimpleNamespace(user=5.0, nice=1.0, system=2.0, idle=100.0, iowait=7.0, irq=0.5, softirq=0.25, steal=0.25,
                            guest=3.0, guest_nice=0.0)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:  # Linux counts guest time inside user already; idle and iowait are idle
        patch.setattr(contention.psutil, "cpu_times", lambda: times)
        assert machine_busy_s() == pytest.approx(9.0)
        patch.setattr(contention.psutil, "cpu_times", lambda: SimpleNamespace(user=5.0, system=2.0, idle=100.0))
        assert machine_busy_s() == pytest.approx(7.0)  # a system without the others (macOS has no irq, Windows no nice)
    busy, own = machine_busy_s(), contention.own_cpu_s()
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of this process's CPU: the machine counts it too
        pass
    assert machine_busy_s() - busy >= contention.own_cpu_s() - own - 0.05  # the counters' ticks (10 ms)


def test_an_adopted_engine_process_is_the_runs_own_work_and_any_other_child_is_not(processes):
    """A backend's worker (adopted, with what it starts) counts as the run's CPU time; a process the caller
    started beside the run is another's, though it is this process's child."""
    spin = "import subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n" \
           "print('busy', flush=True)\nwhile True: pass"  # fmt: skip
    worker = processes.popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "busy\n"
    own = contention.own_cpu_s()
    time.sleep(0.3)
    assert contention.own_cpu_s() - own < 0.1  # two spinning processes, neither adopted
    engine_processes.adopt(worker.pid)
    try:
        own = contention.own_cpu_s()
        deadline = time.monotonic() + 5.0  # a loaded machine gives the spinners their 0.15 s of CPU later, not never
        while contention.own_cpu_s() - own <= 0.15 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert contention.own_cpu_s() - own > 0.15  # the worker and the process it started: 0.6 s a 0.3 s on 2 cores
    finally:
        engine_processes.release(worker.pid)
    assert worker.pid not in engine_processes.adopted()


def test_a_row_is_disturbed_beyond_either_threshold_and_unmeasurable_means_undisturbed():
    assert not Contention(2.0, 0.2, None).disturbed(0.25)  # 0.1 cores
    assert Contention(2.0, 1.0, None).disturbed(0.25)  # 0.5 cores
    assert Contention(2.0, 0.0, 40.0).disturbed(0.25, 10.0)  # another process on the GPU
    assert not Contention(2.0, None, None).disturbed() and Contention(2.0, None, None).other_load is None


def test_no_cpu_counters_give_no_measurement(monkeypatch):
    def unreadable():
        raise psutil.AccessDenied()

    monkeypatch.setattr(contention.psutil, "cpu_times", unreadable)
    meter = ContentionMeter(GpuWatch())
    meter.start()
    assert meter.stop().other_cpu_s is None and machine_busy_s() is None


def test_gpu_use_of_other_processes_is_read_from_nvml_and_our_own_is_not():
    me = __import__("os").getpid()
    samples = [SimpleNamespace(pid=me, smUtil=95), SimpleNamespace(pid=me + 1, smUtil=30)]
    nvml = SimpleNamespace(nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
                           nvmlDeviceGetProcessUtilization=lambda handle, since: samples if handle == 1 else [])  # fmt: skip
    assert GpuWatch(nvml).others_peak(0) == 30.0
    assert GpuWatch().others_peak(0) is None  # no NVML: not measured


def test_a_busy_machine_is_seen_and_an_idle_one_is_not(machine):
    meter, simulated = ContentionMeter(gpu=GpuWatch()), machine(0.0)
    assert meter.sample(0.2).other_load < contention.DEFAULT_THRESHOLD
    simulated.set_cores(1.0)  # one core kept busy
    busy = meter.sample(0.2)
    assert busy.other_load > 0.5 and busy.disturbed()


@pytest.mark.slow
def test_a_run_beside_a_busy_process_flags_its_rows_and_leaves_them_out_of_the_speedup(tmp_path, processes, tiny_target):
    """The one run beside a real competing process (one core kept busy), on the other core (one torch
    thread); the other tests here measure a simulated machine, since the real one is shared. The flags
    hold for any model: the tiny target (conftest.tiny_target), its decodes long enough (32 new tokens)
    that each timed interval spans many of the CPU counters' 10 ms ticks."""
    competitor = processes.popen([sys.executable, "-c", BUSY.format(seconds=120.0)], stdout=subprocess.PIPE, text=True)
    assert competitor.stdout.readline() == "busy\n"  # it spins from here on: the run starts beside it, not before it
    competitor.stdout.close()
    done = app(*SMOKE, *TINY, "max_new_tokens=32", "threads=1", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    rows = list(read_rows(tmp_path / "records.jsonl"))
    assert all(row["disturbed"] and row["other_load"] > contention.DEFAULT_THRESHOLD for row in rows)
    assert "were timed while other processes used the machine" in done.stdout
    summary = pd.read_csv(tmp_path / "summary.csv").set_index("method")
    assert summary.loc["mars", "disturbed"] == 2 and pd.isna(summary.loc["mars", "speedup"])
    assert json.loads((tmp_path / "manifest.json").read_text())["machine_load"]["other_load"] is not None


@pytest.mark.slow
def test_retry_disturbed_times_a_row_again_once_the_machine_is_idle(tmp_path, machine, tiny_target):
    machine(1.0, intervals=2)  # a core busy while the manifest samples the load and the first decode is timed, then idle
    done = app(*SMOKE, *TINY, "retry_disturbed=2", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    rows = list(read_rows(tmp_path / "records.jsonl"))
    assert rows[0]["retimed"] >= 1
    assert not any(row["disturbed"] for row in rows)  # every row's final timing was on the idle machine


@pytest.mark.slow
def test_an_idle_run_is_flagged_nowhere(tmp_path, machine, tiny_target):
    machine(0.0)
    done = app(*SMOKE, *TINY, f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    rows = list(read_rows(tmp_path / "records.jsonl"))
    assert not any(row["disturbed"] for row in rows) and all(row["other_load"] is not None for row in rows)
    assert "were timed while other processes" not in done.stdout


def paired_rows(disturbed: set[tuple[str, int]]) -> list[dict]:
    """Two prompts of 10 tokens: the baseline takes 2 s and 4 s, the method 1 s each, so the speedup is
    (20 / 2) / (20 / 6) = 3 over both prompts and (10 / 1) / (10 / 2) = 2 over prompt 0 alone."""
    seconds = {("baseline", 0): 2.0, ("mars", 0): 1.0, ("baseline", 1): 4.0, ("mars", 1): 1.0}
    return [{"cell": "c", "model": "qwen", "drafter": "model", "task": "humaneval", "temperature": 1.0,
             "verifier": method, "theta": None, "question_id": q, "turn": 1, "method": method, "status": "ok",
             "new_tokens": 10, "prefill_s": 0.0, "decode_s": s, "steps": 3, "drafted": 0, "accepted": 0, "relaxed": 0,
             "trigger_count": None, "verified_positions": 0, "score": None, "agreement": None,
             "disturbed": (method, q) in disturbed}
            for (method, q), s in seconds.items()]  # fmt: skip


@pytest.mark.parametrize("which", [("mars", 1), ("baseline", 1)])
def test_the_summary_leaves_a_prompt_out_of_the_speedup_when_either_of_its_rows_was_disturbed(which):
    summary = summarise(paired_rows({which})).set_index("method")
    assert summary.loc["mars", "speedup"] == pytest.approx(2.0) and summary.loc["mars", "disturbed"] == 1
    kept = summarise(paired_rows({which}), include_disturbed=True).set_index("method")
    assert kept.loc["mars", "speedup"] == pytest.approx(3.0)
    table = format_table(summarise(paired_rows({which})), disturbed_rows(pd.DataFrame(paired_rows({which}))))
    assert "1 row was timed while other processes used the machine (disturbed), left out of the speedups" in table
    assert f"- humaneval question 1 turn 1 · {which[0]}" in table


def test_tokens_per_second_leave_out_the_disturbed_rows_unless_told_to_count_them():
    rows = paired_rows({("baseline", 1)})
    assert summarise(rows).set_index("method").loc["baseline", "tok_per_s"] == pytest.approx(10 / 2)
    assert summarise(rows, include_disturbed=True).set_index("method").loc["baseline", "tok_per_s"] == pytest.approx(20 / 6)


def test_disturbed_rows_are_named_with_their_cell_where_there_are_several_and_their_load():
    rows = [{**row, "other_load": 0.7} for row in paired_rows({("mars", 0), ("baseline", 1)})]
    rows += [{**row, "cell": "d"} for row in paired_rows({("mars", 1)})]
    assert disturbed_rows(pd.DataFrame(rows)) == [
        "c · humaneval question 0 turn 1 · mars: 0.70 other cores",
        "c · humaneval question 1 turn 1 · baseline: 0.70 other cores",
        "d · humaneval question 1 turn 1 · mars",
    ]
    assert disturbed_rows(pd.DataFrame(paired_rows(set()))) == []


def test_the_analysis_says_how_many_rows_were_disturbed_and_can_count_them(tmp_path):
    from analysis.__main__ import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in paired_rows({("mars", 1)})))
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    index = (tmp_path / "out" / "index.md").read_text()
    assert "1 row was timed while other processes used the machine (disturbed), left out" in index
    assert "- humaneval question 1 turn 1 · mars" in index
    settings = pd.read_csv(tmp_path / "out" / "settings.csv")
    assert settings["speedup"].iloc[0] == pytest.approx(2.0) and settings["disturbed"].iloc[0] == 1
    assert main([str(run), "--out", str(tmp_path / "all"), "--include-disturbed"]) == 0
    assert pd.read_csv(tmp_path / "all" / "settings.csv")["speedup"].iloc[0] == pytest.approx(3.0)
