"""The backend seam: a second backend runs a cell with nothing else changed.

The test backend here replays a recorded trace: a first cell runs on the transformers backend, recording each
request's ``DecodeResult``; a second cell, on a backend with no model at all, answers every request from that
recording. The cell, its records, its summary and the analysis take the second backend's rows as they take the
first's, and tell them apart only by the rows' ``backend`` field and what the backend declares of itself
(``own_engine``: the recording backend is this package's engine, the replay not)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from conftest import TINY, run_config

from mars_bench.backends import Backend, PreparedMethod, Requests, TransformersBackend, register_backend
from mars_bench.bench.cell import run_cell
from mars_bench.bench.records import BASELINE
from mars_bench.bench.summary import summarise
from mars_bench.decoding import DecodeResult

CELL = ["experiment=smoke", *TINY, "drafter=lookup", "task=mt_bench", "task.num_prompts=3", "max_new_tokens=8",
        "warmup=0", "progress=false", "threads=1", "temperature=1", "shadow=[rejection]"]  # fmt: skip
TRACE: dict[tuple[str, tuple[int, ...], int], DecodeResult] = {}  # (method, prompt, seed) -> what was decoded


class RecordingBackend(TransformersBackend):
    """The transformers backend, keeping every request's result in ``TRACE``."""

    name: ClassVar[str] = "recording"

    def generate(self, method: PreparedMethod, requests: Requests) -> list[DecodeResult]:
        results = super().generate(method, requests)
        for prompt, seed, result in zip(requests.prompts, requests.seeds, results):
            TRACE[(method.label, tuple(prompt), seed)] = result
        return results


class ReplayBackend(Backend):
    """A backend with no model: each request's result is the recorded one (tokens, timings and step trace)."""

    name: ClassVar[str] = "replay"

    def __init__(self, cfg: Any) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(cfg.model.target)
        self.calls: list[int] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._tokenizer.eos_token_id,)

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu")

    def models(self) -> dict[str, Any]:
        return {}

    def prepare(self, label: str, spec: Any) -> PreparedMethod:
        return PreparedMethod(label, spec)

    def describe(self, method: PreparedMethod) -> dict[str, Any]:
        return {"replayed": method.label}

    def generate(self, method: PreparedMethod, requests: Requests) -> list[DecodeResult]:
        return [TRACE[(method.label, tuple(prompt), seed)] for prompt, seed in zip(requests.prompts, requests.seeds)]


@pytest.fixture(scope="module")
def recorded_and_replayed(tmp_path_factory, tiny_target):
    register_backend(RecordingBackend.name, RecordingBackend)
    register_backend(ReplayBackend.name, ReplayBackend)
    folder = tmp_path_factory.mktemp("seam")
    recorded = run_cell(run_config(*CELL, "backend=recording"), folder / "recorded", name="cell")
    replayed = run_cell(run_config(*CELL, "backend=replay"), folder / "replayed", name="cell")
    return recorded, replayed


DIFFERENT = {"backend", "own_engine", "other_cpu_s", "other_load", "other_gpu_util", "disturbed", "retimed", "peak_memory_mb"}


@pytest.mark.slow  # over a second with its fixture
def test_a_second_backend_runs_the_cell_with_nothing_else_changed(recorded_and_replayed):
    recorded, replayed = recorded_and_replayed
    key = lambda row: (str(row["question_id"]), row["turn"], row["method"])  # noqa: E731
    assert sorted(map(key, recorded)) == sorted(map(key, replayed)) and len(recorded) == 3 * 2 * 2  # 2 turns, 2 methods
    by_key = {key(row): row for row in recorded}
    for row in replayed:
        original = by_key[key(row)]
        assert row["status"] == "ok" and (original["backend"], row["backend"]) == ("recording", "replay")
        assert (original["own_engine"], row["own_engine"]) == (True, False)  # each class's Backend.own_engine
        assert {name: value for name, value in row.items() if name not in DIFFERENT} == {
            name: value for name, value in original.items() if name not in DIFFERENT
        }  # tokens, text, score, per-step trace, shadows, timings: all as recorded
    assert any(row["steps"] > 0 and row["method"] != BASELINE for row in replayed)


@pytest.mark.slow  # over a second with its fixture
def test_the_summary_and_the_analysis_know_the_backend_only_by_the_records_field(recorded_and_replayed, tmp_path):
    import pandas as pd

    recorded, replayed = recorded_and_replayed
    first, second = summarise(recorded, include_disturbed=True), summarise(replayed, include_disturbed=True)
    columns = [column for column in first.columns if column not in ("backend", "disturbed")]  # contention: measured anew
    pd.testing.assert_frame_equal(first[columns], second[columns])


class QueueReplayBackend(ReplayBackend):
    """The replay backend as one that serves a queue (as vLLM does): it records each call's request count."""

    name: ClassVar[str] = "queue_replay"
    serves_a_queue: ClassVar[bool] = True

    def generate(self, method: PreparedMethod, requests: Requests) -> list[DecodeResult]:
        CALLS.append((method.label, len(requests.prompts)))
        return super().generate(method, requests)


CALLS: list[tuple[str, int]] = []


@pytest.mark.slow  # over a second with its fixture
def test_a_backend_that_serves_a_queue_gets_every_question_of_a_turn_in_one_call(recorded_and_replayed, tmp_path):
    """batch_size=2 over 3 questions: a batch backend gets chunks of 2 and 1; a queue-serving one all 3 at once
    (it keeps batch_size in flight itself), turn by turn, with the same rows."""
    recorded, _ = recorded_and_replayed
    register_backend(QueueReplayBackend.name, QueueReplayBackend)
    CALLS.clear()
    rows = run_cell(run_config(*CELL, "backend=queue_replay", "batch_size=2"), tmp_path / "queue", name="cell")
    assert {count for _, count in CALLS} == {3} and len(CALLS) == 4  # 2 turns x 2 methods, the 3 questions each
    assert len(rows) == len(recorded)
