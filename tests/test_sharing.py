"""Files shared by many jobs, on one machine or many over a shared filesystem: a file is created
whole by exactly one of the processes racing for it, a claim is held by one process at a time and
broken only when its owner is gone, each shared baseline is decoded once, and a cell's records are
written by one process at a time, so nothing is torn or duplicated."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mars_bench.bench.baseline_cache import BaselineCache, cache_entries
from mars_bench.bench.cell import CELL_CLAIM
from mars_bench.bench.claims import Claim
from mars_bench.bench.records import Record, RecordWriter, read_rows
from mars_bench.common.files import atomic_create, atomic_replace

KEYS = [f"{index:064x}" for index in range(8)]


def test_a_file_is_created_once_and_whole(tmp_path):
    path = tmp_path / "entry.json"
    assert atomic_create(path, b"first") and not atomic_create(path, b"second")
    assert path.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["entry.json"]  # no temporary left


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    atomic_replace(path, b"old")
    atomic_replace(path, b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_replace(path, b"newer")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary left


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_claim(path: Path, **holder) -> None:
    import socket

    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "job": None, **holder}))


def test_a_claim_is_held_by_one_process_and_broken_only_when_stale(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    path = tmp_path / "x.claim"
    write_claim(path)  # held by a live process of this host (our parent)
    assert not Claim(path).take() and not Claim(path).stale()
    write_claim(path, pid=dead_pid())  # its owner died on this host
    claim = Claim(path)
    assert claim.take() and json.loads(path.read_text())["pid"] == os.getpid()
    claim.release()
    assert not path.exists()
    write_claim(path, host="another-node")  # a live-looking owner elsewhere: only its lease can expire
    assert not Claim(path).take()
    old = time.time() - 7200
    os.utime(path, (old, old))
    assert Claim(path, lease_s=3600).take()


def test_a_requeued_slurm_job_takes_its_own_claim_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    path = tmp_path / "x.claim"
    write_claim(path, host="node-before-requeue", job="4242")
    assert Claim(path).take()
    write_claim(path, host="another-node", job="4243")
    assert not Claim(path).take()


def racer(rounds: list[tuple[str, str, str]], start: multiprocessing.synchronize.Barrier) -> None:
    """One of several processes, round after round (each in folders of its own, all the processes starting it
    at once): decode (pretend) each shared baseline unless another process has, then write the rows of one
    cell folder that are not there yet."""
    for cache_dir, records_dir, log_dir in rounds:
        race(cache_dir, records_dir, log_dir, start)


def race(cache_dir: str, records_dir: str, log_dir: str, start: multiprocessing.synchronize.Barrier) -> None:
    cache = BaselineCache(cache_dir, poll_s=0.005)
    start.wait()
    decoded = []
    for key in KEYS:
        if cache.get_or_claim(key) is None:
            time.sleep(0.005)  # the decode
            cache.put(key, {"key": key, "by": os.getpid()})
            decoded.append(key)
    Path(log_dir, f"{os.getpid()}.json").write_text(json.dumps(decoded))
    claim = Claim(Path(records_dir) / CELL_CLAIM)
    while not claim.take():
        claim.wait(0.005)
    try:
        writer = RecordWriter(Path(records_dir))
        for index, key in enumerate(KEYS):
            record = Record(cell="c", model="m", target="t", draft_model=None, drafter="d", gamma=1, verifier="v",
                            verifier_setting="", temperature=0.0, top_p=1.0, top_k=0, task="x",
                            seed=0, max_new_tokens=1, dtype="float32", attn_implementation="sdpa", device_map=None,
                            scorer=None, threads=None, batch_size=1, question_id=index, category="", turn=1,
                            method="baseline", output_text=key * 50)  # fmt: skip
            if not writer.has(record.key):
                writer.write(record)
                claim.beat()
    finally:
        claim.release()


@pytest.mark.slow
def test_four_processes_racing_on_one_cache_and_one_records_folder_leave_nothing_torn_or_twice(tmp_path):
    """20 races of 4 processes, each race in fresh folders; the same 4 processes run them one after the other
    (a fork of this process costs more than a race)."""
    context = multiprocessing.get_context("fork")
    rounds = [tuple(tmp_path / str(repeat) / name for name in ("cache", "records", "logs")) for repeat in range(20)]
    for folder in (folder for round_ in rounds for folder in round_):
        folder.mkdir(parents=True)
    start = context.Barrier(4, timeout=60)  # a racer that fails breaks the barrier for the others
    processes = [context.Process(target=racer, args=([tuple(map(str, round_)) for round_ in rounds], start)) for _ in range(4)]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    assert [process.exitcode for process in processes] == [0] * 4
    for cache, records, logs in rounds:
        decoded = [key for log in logs.iterdir() for key in json.loads(log.read_text())]
        assert sorted(decoded) == KEYS  # every baseline decoded by exactly one process
        entries = [json.loads(path.read_text()) for path in cache_entries(cache)]
        assert sorted(entry["key"] for entry in entries) == KEYS and all(entry["row"]["key"] == entry["key"] for entry in entries)
        lines = (records / "records.jsonl").read_text().splitlines()
        assert len(lines) == len(KEYS) and sorted(json.loads(line)["question_id"] for line in lines) == list(range(len(KEYS)))
        assert not [p.name for p in (*cache.iterdir(), *records.iterdir()) if p.suffix in (".claim", ".tmp")]


def test_a_baseline_whose_decoder_died_is_decoded_by_the_next_job(tmp_path):
    cache = BaselineCache(tmp_path, poll_s=0.01)
    write_claim(tmp_path / f"{KEYS[0]}.claim", pid=dead_pid())
    assert cache.get_or_claim(KEYS[0]) is None  # claimed by us now
    assert cache.put(KEYS[0], {"a": 1}) == {"a": 1} and not (tmp_path / f"{KEYS[0]}.claim").exists()
    assert BaselineCache(tmp_path).get_or_claim(KEYS[0]) == {"a": 1}


def test_a_cache_written_by_older_versions_is_still_read(tmp_path):
    (tmp_path / "baselines.jsonl").write_text(json.dumps({"key": KEYS[1], "row": {"b": 2}}) + "\n")
    assert BaselineCache(tmp_path).get(KEYS[1]) == {"b": 2}
    schema_6 = {"b": 3, "theta": 0.9, "guard": "never"}  # fields that records no longer have
    (tmp_path / f"{KEYS[2]}.json").write_text(json.dumps({"key": KEYS[2], "row": schema_6}))
    assert BaselineCache(tmp_path).get(KEYS[2]) == {"b": 3}


@pytest.mark.slow
def test_a_run_waits_while_another_live_process_writes_its_folder_then_takes_it_over(tmp_path, tiny_target, monkeypatch):
    """The other writer ends 0.3 s after the run starts waiting, which it does polling every 10 ms (the app's
    2 s poll would only add its sleep)."""
    from conftest import SMOKE, TINY, app

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    write_claim(tmp_path / CELL_CLAIM, pid=other.pid)
    wait, writer_alive_when_waited = Claim.wait, []

    def wait_while_the_other_writes_a_while_longer(claim, poll_s=2.0, done=None):
        if claim.path == tmp_path / CELL_CLAIM and not writer_alive_when_waited:
            writer_alive_when_waited.append(other.poll() is None)
            threading.Timer(0.3, other.kill).start()
        wait(claim, 0.01, done)

    monkeypatch.setattr(Claim, "wait", wait_while_the_other_writes_a_while_longer)
    try:
        done = app(*SMOKE, *TINY, f"hydra.run.dir={tmp_path}")
    finally:
        other.kill()
        other.wait()
    assert done.returncode == 0, done.stderr
    assert f"{tmp_path} is being written by" in done.stderr and "waiting" in done.stderr and writer_alive_when_waited == [True]
    assert len(list(read_rows(tmp_path / "records.jsonl"))) == 4 and not (tmp_path / CELL_CLAIM).exists()


def test_the_baseline_key_hashes_the_conditions_every_record_carries_and_is_the_one_earlier_versions_wrote():
    from types import SimpleNamespace as Namespace

    from conftest import run_config

    from mars_bench.bench.baseline_cache import baseline_conditions, baseline_key
    from mars_bench.bench.cell import cell_keys
    from mars_bench.bench.records import BASELINE_CONDITIONS
    from mars_bench.config.method import method_spec

    cfg = run_config("experiment=smoke", "max_new_tokens=24")
    assert tuple(baseline_conditions(cfg)) == BASELINE_CONDITIONS
    keys = cell_keys(cfg, "c", method_spec(cfg))
    assert {name: keys[name] for name in BASELINE_CONDITIONS} == baseline_conditions(cfg)  # the records' own
    model = Namespace(target="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="bfloat16", attn_implementation="sdpa", device_map=None)
    old = Namespace(model=model, task=Namespace(name="humaneval", scorer="humaneval"), temperature=1.0, top_p=1.0, top_k=0,
                    max_new_tokens=24, seed=0, threads=None)  # fmt: skip
    # the key of this baseline as the version before BASELINE_CONDITIONS hashed it: shared caches keep matching
    key = baseline_key(old, "HumanEval/0", [1, 2, 3], 1000003)
    assert key == "8ddc192b3a5b0edac75a44e2d9513d7d2945ec9b0e0d330bc1f1a7bf64d032cc"
    assert baseline_key(Namespace(**{**vars(old), "max_new_tokens": 25}), "HumanEval/0", [1, 2, 3], 1000003) != key
