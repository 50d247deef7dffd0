"""One sweep cell: its backend built once, a warm-up, then the baseline and the configured method on
every question, in the one schedule of ``schedule.py`` (B questions at a time; B = 1 is a chunk of one).
Where the backend's plan says its methods cannot be held together (``Backend.plan_methods``: vLLM's engines
that do not fit in memory side by side), each runs over every question in turn, the baseline first, and is
released before the next is prepared.

The pieces: the backend loads and runs (``mars_bench/backends``), ``schedule.py`` orders the work,
``timing.py`` times it, ``rows.py`` builds the records and ``writing.py`` writes them."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from mars_bench.backends import PreparedMethod, Requests, make_backend
from mars_bench.backends.base import EngineStopped
from mars_bench.backends.hf import cached_model, forget_loaded_models, load_models
from mars_bench.bench.baseline_cache import BaselineCache, baseline_key, batch_baseline_key
from mars_bench.bench.claims import Claim
from mars_bench.bench.contention import ContentionMeter
from mars_bench.bench.duration import measured_lengths
from mars_bench.bench.failures import is_cell_failure
from mars_bench.bench.manifest import build_manifest, write_manifest
from mars_bench.bench.progress import TokenProgress
from mars_bench.bench.records import BASELINE, Record
from mars_bench.bench.rows import RowBuilder, batch_fields, cell_keys, failure_record
from mars_bench.bench.run_folder import CELL_CLAIM, write_config
from mars_bench.bench.schedule import Conversation, run_schedule
from mars_bench.bench.timing import DecodeTimer
from mars_bench.bench.writing import PairedWriter
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import shadow_verifiers
from mars_bench.config.tuning import take_back_tuning
from mars_bench.decoding import DecodeResult
from mars_bench.decoding.stop_strings import StopStrings
from mars_bench.method import MethodSpec
from mars_bench.models.loading import chat_prompt_ids
from mars_bench.tasks import SCORERS, Question
from mars_bench.tasks.judge import JudgeScorer, load_judge_prompts
from mars_bench.tasks.prompting import task_stop_strings, user_text
from mars_bench.tasks.providers import serve_questions
from mars_bench.tasks.safety.scoring import SAFETY_SCORERS, build_safety_scorer
from mars_bench.tasks.scoring import Judged

__all__ = ["CELL_CLAIM", "Cell", "cell_keys", "failure_record", "forget_loaded_models", "load_models", "run_cell"]


class Cell:
    """Everything one cell needs, built from the resolved config; ``spec``: its method, where the caller has built it
    (``check_run_config``)."""

    def __init__(self, cfg: Any, folder: Path, name: str, on_write: Any = None, spec: MethodSpec | None = None) -> None:
        self.load_meter = ContentionMeter()  # other processes' use while the cell loads: the manifest's machine_load
        self.load_meter.start()
        self.spec = check_run_config(cfg, spec)  # the cell's method, built once
        self.cfg, self.folder, self.name = cfg, folder, name
        served = serve_questions(cfg.task, cfg.data_dir)
        self.questions, self.question_source = served.questions, served.source
        self.writer = PairedWriter(folder, on_write)  # on_write: the cell claim's heartbeat
        self.backend = make_backend(cfg)
        tokenizer = self.backend.tokenizer
        self.stops = self.backend.stop_token_ids
        self.stop_strings = task_stop_strings(cfg.task)
        # accuracy_only: the method alone, untimed (no baseline to pair a speed with, no warm-up, no contention)
        baseline = {} if cfg.accuracy_only else {BASELINE: MethodSpec(sampling=self.spec.sampling)}
        self.specs: dict[str, MethodSpec] = {**baseline, cfg.verifier.name: self.spec}  # the order of one at a time
        self.methods: list[PreparedMethod] = []  # those prepared now, in the order of ``specs``
        try:
            self.plan = self.backend.plan_methods(self.specs)
            if self.plan.together:
                prepared = {label: self.backend.prepare(label, spec) for label, spec in reversed(self.specs.items())}
                self.methods = [prepared[label] for label in self.specs]
            else:  # news to the user: the baseline's rows all come first, and no chunk alternates
                print(f"mars_bench: {self.plan.line}", file=sys.stderr)
            self.scorer = self.build_scorer()  # a judge's model loads after the engines (vLLM sizes itself first)
        except EngineStopped as error:
            self.backend.close()
            raise self.stopped(error) from None
        except BaseException:  # what was prepared goes (an engine holds its memory) before the cell fails
            self.backend.close()
            raise
        self.shadows = shadow_verifiers(cfg)
        self.rows = RowBuilder(cell_keys(cfg, name, self.spec), tokenizer, tuple(self.stop_strings), tuple(self.shadows))
        self.baselines = BaselineCache(cfg.baseline_cache) if cfg.baseline_cache else None
        self.timer = DecodeTimer(cfg, self.backend.device)
        self.on_tokens: Any = None  # the progress bar's, while a lone request decodes

    def build_scorer(self) -> Any:
        task, model = self.cfg.task, self.cfg.model

        def load(name: str) -> Any:  # a judge model, placed and typed as the target
            return cached_model(name, model.dtype, model.device_map, model.attn_implementation, None, None, model.kernels)

        if task.scorer == "judge":
            return JudgeScorer(load(task.judge_model), load_judge_prompts(self.cfg.data_dir), task.judge_max_new_tokens)
        if task.scorer in SAFETY_SCORERS:
            return build_safety_scorer(task, load)
        return SCORERS.get(task.scorer) if task.scorer else None

    def decode(self, method: PreparedMethod, prompts: list[list[int]], seeds: list[int],
               max_new_tokens: int | None = None) -> list[DecodeResult]:  # fmt: skip
        """``prompts`` decoded together by the backend with ``method``, each with its own seed."""
        stop_when = StopStrings(self.backend.tokenizer, tuple(self.stop_strings)) if self.stop_strings else None
        requests = Requests(prompts, seeds, max_new_tokens or self.cfg.max_new_tokens, self.stops, stop_when,
                            tuple(self.shadows.values()), self.cfg.fidelity, self.on_tokens)  # fmt: skip
        return self.backend.generate(method, requests)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat prompt of ``messages`` in the task's prompt format (``tasks/prompting.py``)."""
        task, kwargs = self.cfg.task, dict(self.cfg.model.chat_template_kwargs or {})
        shaped = [{**m, "content": user_text(task, m["content"])} if m["role"] == "user" else m for m in messages]
        return chat_prompt_ids(self.backend.tokenizer, shaped, task.system_prompt, task.answer_prefix, **kwargs)

    def planned(self) -> list[tuple[str, int, str]]:
        """The key of every row the cell writes: (question, turn, method)."""
        return [(str(q.question_id), turn, label) for q in self.questions for turn in range(1, len(q.turns) + 1)
                for label in self.specs]  # fmt: skip

    def warm_up(self) -> None:
        """Decode the first question's first turn (up to 16 tokens) ``warmup`` times per method, as the
        cell decodes: in a batch of ``batch_size`` copies (one, alone)."""
        prompt = self.prompt_ids([{"role": "user", "content": self.questions[0].turns[0]}])
        budget, rows = min(16, self.cfg.max_new_tokens), min(self.cfg.batch_size, len(self.questions))
        for _ in range(self.cfg.warmup):
            for method in self.methods:
                self.decode(method, [prompt] * rows, [self.cfg.seed] * rows, max_new_tokens=budget)

    def seed(self, index: int, turn: int) -> int:
        """The seed of question ``index``'s turn ``turn`` (the manifest's ``per_turn``)."""
        return self.cfg.seed * 1_000_003 + index * 101 + turn

    def run(self, progress: bool = True) -> list[dict[str, Any]]:
        """Decode and write every missing row; the cell's rows (a whole-cell failure an earlier run wrote left out:
        this one went past it). ``EngineStopped`` (one line, naming the rows kept) where an engine died."""
        config = OmegaConf.to_container(self.cfg, resolve=True)
        seeds = {"seed": self.cfg.seed, "per_turn": "seed * 1_000_003 + question_index * 101 + turn"}
        methods = {method.label: self.backend.describe(method) for method in self.methods}
        self.manifest = build_manifest(config, self.backend.models(), seeds, methods, self.question_source, self.load_meter)
        if self.plan.line is not None:
            self.manifest["methods_plan"] = {"together": self.plan.together, "line": self.plan.line}
        self.manifest_path = write_manifest(self.folder, self.manifest)
        planned = self.planned()
        kept = [self.writer.rows[key] for key in planned if self.writer.has(key)]
        measured = measured_lengths(self.cfg.model.name, self.cfg.task.name)
        with TokenProgress(planned, self.cfg.max_new_tokens, kept, desc=self.name, disable=not progress,
                           measured=measured) as bar:  # fmt: skip
            self.on_tokens = bar.tick if progress and self.cfg.batch_size == 1 else None
            queue = self.backend.serves_a_queue and self.cfg.batch_size > 1  # at B = 1 a queue is one prompt at a time
            width = len(self.questions) if queue else self.cfg.batch_size
            try:
                if self.plan.together:
                    if len(kept) < len(planned) and not self.cfg.accuracy_only:
                        self.warm_up()
                    run_schedule(self, width, bar)
                else:
                    self.run_one_at_a_time(planned, width, bar)
            except EngineStopped as error:
                raise self.stopped(error) from None
        return [row for row in self.writer.rows.values() if not is_cell_failure(row)]

    def run_one_at_a_time(self, planned: list[tuple[str, int, str]], width: int, bar: Any) -> None:
        """Each method in turn (``specs``' order: the baseline first) prepared, warmed up, run over every question
        and released before the next is prepared; a method whose rows are all written is not prepared at all."""
        for label, spec in self.specs.items():
            if all(self.writer.has(key) for key in planned if key[2] == label):
                continue
            method = self.backend.prepare(label, spec)
            self.manifest["methods"][label] = self.backend.describe(method)
            self.manifest_path.write_text(json.dumps(self.manifest, indent=1, default=str))
            self.methods = [method]
            try:
                if not self.cfg.accuracy_only:
                    self.warm_up()
                run_schedule(self, width, bar)
            finally:
                self.methods = []
                self.backend.release(method)

    def stopped(self, error: EngineStopped) -> EngineStopped:
        """``error`` (an engine died), saying which rows are kept and how a rerun resumes them, in one line."""
        rows = sum(1 for row in self.writer.rows.values() if not is_cell_failure(row))
        return EngineStopped(f"{error}; the {rows} row{'' if rows == 1 else 's'} written before are kept in "
                             f"{self.writer.path} (output_dir={self.folder} resumes the cell)")  # fmt: skip

    def decode_turns(self, number: int, turn: int, batch: list[Conversation], method: PreparedMethod) -> list[Record]:
        """The records of one batch: every conversation's turn ``turn`` decoded together (or, for a baseline
        another cell of the sweep decoded, copied); a failure row for each where the batch failed."""

        def failed(error: Exception) -> list[Record]:
            return [failure_record(self.cfg, self.name, self.spec, error, c.question, turn, method.label) for c in batch]

        try:
            prompts = [self.prompt_ids(c.messages) for c in batch]
            seeds = [self.seed(c.index, turn) for c in batch]
        except Exception as error:  # a chat template that cannot take these messages
            return failed(error)
        shared = not method.judged and self.baselines is not None
        key = self.shared_key(batch, prompts, seeds) if shared else ""
        if shared and (kept := self.baselines.get_or_claim(key)) is not None:
            return [self.rows.copied_baseline(row) for row in kept.get("rows", [kept])]
        try:
            results, contention, retimed = self.timer.timed(lambda: self.decode(method, prompts, seeds))
        except Exception as error:  # out of memory: every row of the batch says so, and the cell goes on
            if shared:
                self.baselines.release(key)
            if isinstance(error, EngineStopped):  # but an engine that died decodes no more: the cell stops
                raise
            return failed(error)
        records = []
        for conversation, prompt, result, place in zip(batch, prompts, results, batch_fields(number, turn, results)):
            record = self.rows.record(conversation.question, turn, method, prompt, result, place)
            self.timer.stamp(record, contention, retimed)
            try:
                self.score(record, conversation.question, turn, conversation.answers)
            except Exception as error:  # a scorer bug fails this row only
                record = failure_record(self.cfg, self.name, self.spec, error, conversation.question, turn, method.label)
            records.append(record)
        if shared and all(record.status == "ok" for record in records):
            rows = [asdict(record) for record in records]
            self.baselines.put(key, rows[0] if len(rows) == 1 else {"rows": rows})  # a lone row as earlier versions kept it
        elif shared:
            self.baselines.release(key)  # a batch with a failed row is for another job to decode again
        return records

    def shared_key(self, batch: list[Conversation], prompts: list[list[int]], seeds: list[int]) -> str:
        """The shared baseline cache's key of a batch (of a lone row: its own key, as earlier versions wrote it)."""
        rows = [(c.question.question_id, prompt, seed) for c, prompt, seed in zip(batch, prompts, seeds)]
        return baseline_key(self.cfg, *rows[0]) if len(rows) == 1 else batch_baseline_key(self.cfg, rows)

    def score(self, record: Record, question: Question, turn: int, answers: list[str]) -> None:
        """The record's score (``answers``: this method's earlier turns of the question), with a safety scorer's
        verdicts."""
        if self.scorer is not None:
            answer = record.output_text
            score = self.scorer(answer, question, turn=turn, answers=[*answers, answer])
            record.score, record.safety = (score.score, score.verdicts) if isinstance(score, Judged) else (score, {})


def run_cell(cfg: Any, folder: Path, name: str | None = None, spec: MethodSpec | None = None) -> list[dict[str, Any]]:
    """Run one cell into ``folder``, resuming its records; a second process given the same folder
    (two launches of one sweep, a requeued job whose old self still runs) waits until the first is done.
    ``spec``: the method ``cfg`` names, where the caller has built it (``configured_spec``, the tuning taken back)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder.mkdir(parents=True, exist_ok=True)
    claim = Claim(folder / CELL_CLAIM)
    while not claim.take():
        print(f"mars_bench: {folder} is being written by {claim.holder()}; waiting", file=sys.stderr)
        claim.wait()
    try:
        take_back_tuning(cfg)  # the config written is the one run (a multirun's cells are checked only here)
        write_config(folder, cfg)  # first: a run stopped even while its models load is its configuration's to resume
        cell = Cell(cfg, folder, name or folder.name, on_write=claim.beat, spec=spec)
        try:
            return cell.run(progress=cfg.progress)
        finally:
            cell.backend.close()
    finally:
        claim.release()
