"""One sweep cell: load once, warm up, then for every question the baseline and the
configured method, order alternating per question, each turn written as one record."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from mars_bench.bench.baseline_cache import BaselineCache, baseline_conditions, baseline_key
from mars_bench.bench.batches import run_batches
from mars_bench.bench.claims import Claim
from mars_bench.bench.contention import Contention, ContentionMeter
from mars_bench.bench.manifest import build_manifest, write_manifest
from mars_bench.bench.peak_memory import PeakMemory
from mars_bench.bench.progress import TokenProgress
from mars_bench.bench.records import BASELINE, BUDGET, SCHEMA_VERSION, Record, RecordWriter, finite_or_none
from mars_bench.bench.run_folder import CELL_CLAIM, write_config
from mars_bench.common.settings import plugin_label, setting_string
from mars_bench.config import check_run_config, method_spec, shadow_verifiers
from mars_bench.decoding import DecodeResult, decode
from mars_bench.decoding.batched import decode_batch
from mars_bench.decoding.stop_strings import StopStrings
from mars_bench.drafting import drafter_needs_model
from mars_bench.method import MethodSpec
from mars_bench.models.loading import LoadedModel, chat_prompt_ids, check_tokenizers_compatible, load_model, stop_token_ids
from mars_bench.models.placement import input_device
from mars_bench.tasks import SCORERS, Question
from mars_bench.tasks.judge import JudgeScorer, load_judge_prompts
from mars_bench.tasks.prompting import cut_at_stop_string, task_stop_strings, user_text
from mars_bench.tasks.providers import serve_questions
from mars_bench.tasks.scoring import rouge_l
from mars_bench.verification import Verifier


def cached_model(
    name: str,
    dtype: str,
    device_map: str | None,
    attn: str,
    max_memory: tuple | None = None,
    offload_folder: str | None = None,
) -> LoadedModel:
    """Models stay loaded across the cells of a multirun in one process: one load per distinct
    (name, dtype, device_map, attn, max_memory, offload_folder), however the call spells it (a draft
    model equal to the target is the target's object).

    max_memory: a tuple of (device, size) pairs (hashable); offload_folder allows disk offload."""
    return _loaded(name, dtype, device_map, attn, max_memory, offload_folder)


@lru_cache(maxsize=4)
def _loaded(
    name: str, dtype: str, device_map: str | None, attn: str, max_memory: tuple | None, offload_folder: str | None
) -> LoadedModel:
    return load_model(
        name,
        dtype=dtype,
        device_map=device_map,
        attn_implementation=attn,
        max_memory=dict(max_memory) if max_memory else None,
        offload_folder=offload_folder,
    )


def forget_loaded_models() -> None:
    """Drop the models ``cached_model`` holds (the next call loads afresh)."""
    _loaded.cache_clear()


def load_models(cfg: Any) -> dict[str, LoadedModel]:
    """The target (sharded per model.device_map / max_memory, its plan checked before loading)
    and, for drafter=model, the draft model on the target's input device (``drafter_device``)."""
    from mars_bench.models.placement import drafter_device

    m = cfg.model
    memory = tuple(sorted(((str(k), v) for k, v in m.max_memory.items()), key=str)) if m.max_memory else None
    offload_folder = getattr(m, "offload_folder", None)
    models = {"target": cached_model(m.target, m.dtype, m.device_map, m.attn_implementation, memory, offload_folder)}
    if drafter_needs_model(cfg.drafter.name):
        # Unsharded targets keep the default device; sharded ones get the drafter beside their first device.
        place = str(drafter_device(models["target"].model)) if m.device_map else None
        models["drafter"] = cached_model(m.draft_model, m.dtype, place, m.attn_implementation, None)
        check_tokenizers_compatible(models["target"].tokenizer, models["drafter"].tokenizer)
    return models


def cell_keys(cfg: Any, name: str, spec: MethodSpec | None = None) -> dict[str, Any]:
    """The config keys every record of a cell carries, from the cell's method (``spec``; before one
    is built, from the config, without the settings of a method the config cannot build)."""
    model = cfg.model
    spec = spec or configured_spec(cfg)
    settings = spec.verifier_values if spec is not None else {}
    return {
        "cell": name,
        "model": model.name,
        "draft_model": model.draft_model if drafter_needs_model(cfg.drafter.name) else None,
        "drafter": cfg.drafter.name,
        "gamma": cfg.drafter.gamma,
        "verifier": cfg.verifier.name,
        "verifier_setting": setting_string(settings),
        **baseline_conditions(cfg),
        "draft_length": cfg.drafter.length,
        "drafter_setting": spec.drafter_setting if spec is not None else "",
    }


def configured_spec(cfg: Any) -> MethodSpec | None:
    """The configured method, or None where the config cannot build one (the failure row says why)."""
    try:
        return method_spec(cfg)
    except (TypeError, ValueError):
        return None


def failure_record(
    cfg: Any, name: str, error: BaseException, question: Question | None = None, turn: int = 0, method: str = "*"
) -> Record:
    """A row saying what failed: one question's turn, or (question "*") the whole cell."""
    return Record(
        **cell_keys(cfg, name),
        question_id=question.question_id if question else "*",
        category=question.category if question else "",
        turn=turn,
        method=method,
        status="failed",
        error=f"{type(error).__name__}: {error}"[:2000],
    )


@dataclass
class Method:
    """One of a cell's two methods: the spec it was built from, and its built verifier and drafter
    (both None for the autoregressive baseline)."""

    label: str
    spec: MethodSpec
    verifier: Verifier | None
    drafter: Any


class Cell:
    """Everything one cell needs, built from the resolved config."""

    def __init__(self, cfg: Any, folder: Path, name: str, on_write: Callable[[], None] | None = None) -> None:
        check_run_config(cfg)
        self.cfg, self.folder, self.name = cfg, folder, name
        self.on_write = on_write  # called after every record (the cell claim's heartbeat)
        served = serve_questions(cfg.task, cfg.data_dir)
        self.questions, self.question_source = served.questions, served.source
        self.writer = RecordWriter(folder)
        self.models = load_models(cfg)
        self.target = self.models["target"]
        self.stops = stop_token_ids(self.target)
        self.stop_strings = task_stop_strings(cfg.task)
        self.spec = method_spec(cfg)
        baseline = MethodSpec(sampling=self.spec.sampling)
        method = Method(cfg.verifier.name, self.spec, self.spec.build_verifier(), self.build_drafter())
        # accuracy_only: the method alone, untimed (no baseline to pair a speed with, no warm-up, no contention)
        self.methods = [method] if cfg.accuracy_only else [Method(BASELINE, baseline, None, None), method]
        self.scorer = self.build_scorer()
        self.shadows = shadow_verifiers(cfg)
        self.baselines = BaselineCache(cfg.baseline_cache) if cfg.baseline_cache else None
        self.meter = ContentionMeter()
        self.memory = PeakMemory(input_device(self.target.model))
        self.on_tokens: Callable[[int], None] | None = None  # the progress bar's, while the rows are decoded

    def build_scorer(self) -> Any:
        task, model = self.cfg.task, self.cfg.model
        if task.scorer == "judge":
            judge = cached_model(task.judge_model, model.dtype, model.device_map, model.attn_implementation, None)
            return JudgeScorer(judge, load_judge_prompts(self.cfg.data_dir), task.judge_max_new_tokens)
        return SCORERS.get(task.scorer) if task.scorer else None

    def build_drafter(self) -> Any:
        drafter_model = self.models.get("drafter")
        return self.spec.build_drafter(self.target.model, drafter_model.model if drafter_model else None,
                                       head=self.cfg.model.eagle3_head, tokenizer=self.target.tokenizer)  # fmt: skip

    def decode_settings(self, method: Method, max_new_tokens: int | None) -> dict[str, Any]:
        """The arguments ``decode`` and ``decode_batch`` share for ``method``: budget, stops, shadows, fidelity, method."""
        cfg, judged = self.cfg, method.verifier is not None
        stop_when = StopStrings(self.target.tokenizer, self.stop_strings) if self.stop_strings else None
        return {"max_new_tokens": max_new_tokens or cfg.max_new_tokens, "stop_token_ids": self.stops, "stop_when": stop_when,
                "shadow": list(self.shadows.values()) if judged else (), "fidelity": cfg.fidelity and judged,
                **method.spec.decode_kwargs()}  # fmt: skip

    def decode(self, method: Method, prompt: list[int], seed: int, max_new_tokens: int | None = None) -> DecodeResult:
        settings = self.decode_settings(method, max_new_tokens)
        return decode(self.target.model, method.drafter, method.verifier, prompt, seed=seed, on_tokens=self.on_tokens, **settings)

    def decode_rows(
        self, method: Method, prompts: list[list[int]], seeds: list[int], max_new_tokens: int | None = None
    ) -> list[DecodeResult]:
        """``prompts`` decoded together by the batched engine, each with its own seed."""
        settings = self.decode_settings(method, max_new_tokens)
        return decode_batch(self.target.model, method.drafter, method.verifier, prompts, seeds=seeds, **settings)

    def timed(self, decode_now: Callable[[], Any]) -> tuple[Any, Contention | None, int]:
        """``decode_now()`` while measuring what other processes used; a disturbed decode is timed again
        (the same seeds, so the same tokens), each time once the machine is idle, up to ``retry_disturbed``
        times. Returns the last decode's result, its contention and how many times it was timed again
        (with ``accuracy_only``: the one decode, unmeasured, contention None)."""
        cfg, retimed = self.cfg, 0
        if cfg.accuracy_only:
            return decode_now(), None, 0
        while True:
            self.meter.start()
            self.memory.start()
            result = decode_now()
            contention = dataclasses.replace(self.meter.stop(), peak_memory_mb=self.memory.stop())
            if retimed >= cfg.retry_disturbed or not contention.disturbed(cfg.disturbed_load, cfg.disturbed_gpu_util):
                return result, contention, retimed
            self.meter.wait_until_idle(cfg.disturbed_load, cfg.disturbed_gpu_util)
            retimed += 1

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat prompt of ``messages`` in the task's prompt format (``tasks/prompting.py``)."""
        task, kwargs = self.cfg.task, dict(self.cfg.model.chat_template_kwargs or {})
        shaped = [{**m, "content": user_text(task, m["content"])} if m["role"] == "user" else m for m in messages]
        return chat_prompt_ids(self.target.tokenizer, shaped, task.system_prompt, task.answer_prefix, **kwargs)

    def planned(self) -> list[tuple[str, int, str]]:
        """The key of every row the cell writes: (question, turn, method)."""
        return [(str(q.question_id), turn, m.label) for q in self.questions for turn in range(1, len(q.turns) + 1)
                for m in self.methods]  # fmt: skip

    def warm_up(self) -> None:
        """Decode the first question's first turn (up to 16 tokens) ``warmup`` times per method, as the
        cell decodes: alone, or in a batch of ``batch_size`` copies."""
        prompt = self.prompt_ids([{"role": "user", "content": self.questions[0].turns[0]}])
        budget, rows = min(16, self.cfg.max_new_tokens), min(self.cfg.batch_size, len(self.questions))
        for _ in range(self.cfg.warmup):
            for method in self.methods:
                if rows == 1:
                    self.decode(method, prompt, seed=self.cfg.seed, max_new_tokens=budget)
                else:
                    self.decode_rows(method, [prompt] * rows, [self.cfg.seed] * rows, max_new_tokens=budget)

    def seed(self, index: int, turn: int) -> int:
        """The seed of question ``index``'s turn ``turn`` (the manifest's ``per_turn``)."""
        return self.cfg.seed * 1_000_003 + index * 101 + turn

    def run(self, progress: bool = True) -> list[dict[str, Any]]:
        config = OmegaConf.to_container(self.cfg, resolve=True)
        seeds = {"seed": self.cfg.seed, "per_turn": "seed * 1_000_003 + question_index * 101 + turn"}
        methods = {
            method.label: {
                "drafter": method.drafter.describe() if method.drafter is not None else None,
                "verifier": method.verifier.describe() if method.verifier is not None else None,
            }
            for method in self.methods
        }
        write_manifest(self.folder, build_manifest(config, self.models, seeds, methods, self.question_source))
        planned = self.planned()
        kept = [self.writer.rows[key] for key in planned if self.writer.has(key)]
        with TokenProgress(len(planned), self.cfg.max_new_tokens, kept, desc=self.name, disable=not progress) as bar:
            if len(kept) < len(planned) and not self.cfg.accuracy_only:
                self.warm_up()
            if self.cfg.batch_size > 1:
                run_batches(self, bar)
                return list(self.writer.rows.values())
            self.on_tokens = bar.tick if progress else None
            for index, question in enumerate(self.questions):
                order = self.methods if index % 2 == 0 else self.methods[::-1]
                waiting: list[Record] = []  # method rows decoded before their baseline rows exist
                for method in order:
                    for record in self.run_question(index, question, method):
                        bar.add(vars(record))
                        if method.verifier is not None and not self.writer.has((*record.key[:2], BASELINE)):
                            waiting.append(record)
                        else:
                            self.write(record)
                for record in waiting:
                    self.write(record)
        return list(self.writer.rows.values())

    def write(self, record: Record) -> None:
        self.write_batch([record])

    def write_batch(self, records: list[Record]) -> None:
        """Append records together, first comparing each method row's output with its baseline row."""
        for record in records:
            baseline = self.writer.rows.get((str(record.question_id), record.turn, BASELINE))
            if record.method != BASELINE and record.status == "ok" and baseline and baseline["status"] == "ok":
                record.agreement, record.first_divergence = compare(record.output_ids, baseline["output_ids"])
                record.baseline_rouge_l = rouge_l(record.output_text, baseline["output_text"])
        self.writer.write_many(records)
        if self.on_write is not None:
            self.on_write()

    def run_question(self, index: int, question: Question, method: Method) -> Iterator[Record]:
        """Yield the new records of all turns of one question, in order; turn t is conditioned
        on this method's own earlier answers. A failed turn ends the question for this method."""
        messages: list[dict[str, str]] = []
        answers: list[str] = []
        for turn, text in enumerate(question.turns, start=1):
            messages.append({"role": "user", "content": text})
            key = (str(question.question_id), turn, method.label)
            if self.writer.has(key):
                row = self.writer.rows[key]
                if row["status"] != "ok":
                    return  # later turns need this answer
                answer = row["output_text"]
            else:
                try:
                    record = self.decode_turn(index, question, turn, method, messages, answers)
                    answer = record.output_text
                except Exception as error:  # out of memory, a scorer or template bug: record it, go on
                    yield failure_record(self.cfg, self.name, error, question, turn, method.label)
                    return
                yield record
            messages.append({"role": "assistant", "content": answer})
            answers.append(answer)

    def decode_turn(
        self, index: int, question: Question, turn: int, method: Method, messages: list[dict[str, str]], answers: list[str]
    ) -> Record:
        """Decode and score one turn, or copy the baseline row another cell of the sweep decoded."""
        prompt = self.prompt_ids(messages)
        seed = self.seed(index, turn)
        shared = method.verifier is None and self.baselines is not None
        key = baseline_key(self.cfg, question.question_id, prompt, seed) if shared else ""
        if shared and (row := self.baselines.get_or_claim(key)) is not None:
            return self.copied_baseline(row)
        try:
            record = self.decode_and_score(index, question, turn, method, prompt, seed, answers)
            if shared:
                self.baselines.put(key, asdict(record))
        finally:
            if shared:
                self.baselines.release(key)  # a failed decode frees the baseline for another job
        return record

    def copied_baseline(self, row: dict[str, Any]) -> Record:
        """A baseline row another cell of the sweep decoded, as this cell's record."""
        keys = cell_keys(self.cfg, self.name, self.spec)
        copied = {"baseline_from": row["baseline_from"] or row["cell"], "schema_version": SCHEMA_VERSION,
                  "trigger_count": None}  # a baseline verifies nothing (rows cached by schema 3 say 0)  # fmt: skip
        return Record(**{**row, **keys, **copied})  # fields the cached row lacks take their defaults

    def decode_and_score(
        self, index: int, question: Question, turn: int, method: Method, prompt: list[int], seed: int, answers: list[str]
    ) -> Record:
        result, contention, retimed = self.timed(lambda: self.decode(method, prompt, seed=seed))
        record = self.record(question, turn, method, prompt, result, batch_fields(index, turn, [result])[0])
        self.add_contention(record, contention, retimed)
        self.score(record, question, turn, answers)
        return record

    def add_contention(self, record: Record, contention: Contention | None, retimed: int) -> None:
        """What other processes used while the record's decode (its batch's) was timed (None: not measured)."""
        if contention is None:
            return
        disturbed = contention.disturbed(self.cfg.disturbed_load, self.cfg.disturbed_gpu_util)
        for name, value in {**contention.to_record(), "disturbed": disturbed, "retimed": retimed}.items():
            setattr(record, name, value)

    def score(self, record: Record, question: Question, turn: int, answers: list[str]) -> None:
        """The record's score (``answers``: this method's earlier turns of the question)."""
        if self.scorer is not None:
            answer = record.output_text
            record.score = self.scorer(answer, question, turn=turn, answers=[*answers, answer])

    def record(
        self, question: Question, turn: int, method: Method, prompt: list[int], result: DecodeResult, batch: dict[str, Any]
    ) -> Record:
        """The record of one decoded turn; ``batch``: its batch fields (``batch_fields``)."""
        answer = cut_at_stop_string(self.target.tokenizer.decode(result.tokens, skip_special_tokens=True), self.stop_strings)
        cfg = self.cfg
        phases = result.phase_seconds()
        accepted, reached = result.accepted_per_depth()
        z1 = [z for step in result.steps for z in step.top1_logits]
        margins = [r for step in result.steps for r in step.margins]
        is_method = method.verifier is not None
        return Record(
            **cell_keys(cfg, self.name, self.spec),
            question_id=question.question_id,
            category=question.category,
            turn=turn,
            method=method.label,
            prompt_tokens=len(prompt),
            new_tokens=result.new_tokens,
            steps=result.verify_steps,
            tau=finite_or_none(result.tau),
            drafted=result.drafted,
            accepted=result.accepted,
            relaxed=result.relaxed,
            accepted_per_depth=accepted,
            reached_per_depth=reached,
            step_accepted=[step.accepted for step in result.steps],
            step_drafted=[step.drafted for step in result.steps],
            step_draft_s=[step.draft_s for step in result.steps],
            step_target_s=[step.target_s for step in result.steps],
            shadow_accepted=dict(zip(self.shadows, result.shadow_accepted(len(self.shadows)))) if is_method else {},
            trigger_count=result.trigger_count,
            **self.fidelity_fields(method, result),
            verified_positions=len(z1),
            nonpositive_top1=sum(z <= 0 for z in z1),
            margins=[finite_or_none(float(r)) for r in margins],
            reasons=[r for step in result.steps for r in step.reasons],
            prefill_s=result.prefill_s,
            decode_s=result.decode_s,
            draft_s=phases["draft"],
            target_s=phases["target"],
            verify_s=phases["verify"],
            bookkeeping_s=phases["bookkeeping"],
            tokens_per_s=result.tokens_per_s,
            **batch,
            stop_reason=result.stop_reason,
            finished=result.stop_reason != BUDGET,
            output_ids=result.tokens,
            output_text=answer,
        )

    def fidelity_fields(self, method: Method, result: DecodeResult) -> dict[str, Any]:
        """The record's fidelity columns: per verifier label its summed costs, the time they took
        and the live verifier's costs per verified position (aligned with ``margins``)."""
        measured = [step for step in result.steps if step.fidelity is not None]
        if method.verifier is None or not measured:
            return {}
        labels = [plugin_label(method.verifier.name, method.verifier.params), *self.shadows]
        live = [step.fidelity[0] for step in measured]
        costs: dict[str, Any] = {}
        for label, summed in zip(labels, result.fidelity()):
            costs.setdefault(label, summed)  # a shadow of the live rule itself has its costs already
        return {
            "fidelity": costs,
            "fidelity_s": result.fidelity_s,
            "position_accept": [value for costs in live for value in costs.accept[: costs.judged]],
            "position_kl": [
                finite_or_none(value) for costs in live if costs.kl is not None for value in costs.kl[: costs.judged]
            ],
            "position_tv": [value for costs in live for value in costs.tv[: costs.judged]],
        }


def compare(tokens: list[int], baseline: list[int] | None) -> tuple[float | None, int | None]:
    """(share of positions equal to the baseline, first differing position or None)."""
    if baseline is None:
        return None, None
    same = [a == b for a, b in zip(tokens, baseline)]
    length = max(len(tokens), len(baseline), 1)
    divergence = same.index(False) if False in same else (None if len(tokens) == len(baseline) else len(same))
    return sum(same) / length, divergence


def batch_fields(number: int, turn: int, results: list[DecodeResult]) -> list[dict[str, Any]]:
    """The batch fields of the records of ``results``, decoded together as batch ``number`` (the
    questions' index // batch_size) at turn ``turn``: a batch's wall time is its last row's finish."""
    finish = [result.prefill_s + result.decode_s for result in results]
    batch = {"batch_id": f"{number}.{turn}", "batch_rows": len(results), "batch_s": max(finish)}
    return [{**batch, "finish_s": seconds} for seconds in finish]


def run_cell(cfg: Any, folder: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Run one cell into ``folder``, resuming its records; a second process given the same folder
    (two launches of one sweep, a requeued job whose old self still runs) waits until the first is done."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder.mkdir(parents=True, exist_ok=True)
    claim = Claim(folder / CELL_CLAIM)
    while not claim.take():
        print(f"mars_bench: {folder} is being written by {claim.holder()}; waiting", file=sys.stderr)
        claim.wait()
    try:
        write_config(folder, cfg)  # first: a run stopped even while its models load is its configuration's to resume
        return Cell(cfg, folder, name or folder.name, on_write=claim.beat).run(progress=cfg.progress)
    finally:
        claim.release()
