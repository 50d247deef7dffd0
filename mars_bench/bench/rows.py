"""Record building: the keys every record of a cell carries, a decoded turn's record, a failure's row,
a copied baseline's row, and a method row's agreement with its baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mars_bench.backends.base import PreparedMethod
from mars_bench.bench.baseline_cache import baseline_conditions
from mars_bench.bench.records import BUDGET, RECORD_FIELDS, SCHEMA_VERSION, Record, finite_or_none
from mars_bench.common.settings import setting_string
from mars_bench.config.tuning import own_engine
from mars_bench.decoding.trace import DecodeResult
from mars_bench.drafting import drafter_needs_model
from mars_bench.method import MethodSpec
from mars_bench.tasks import Question
from mars_bench.tasks.prompting import cut_at_stop_string


def cell_keys(cfg: Any, name: str, spec: MethodSpec | None) -> dict[str, Any]:
    """The config keys every record of a cell carries, from the cell's method (``spec``; None: a method the config
    cannot build, whose settings it leaves out)."""
    model = cfg.model
    settings = spec.verifier_values if spec is not None else {}
    conditions = baseline_conditions(cfg)
    return {
        "cell": name,
        "model": model.name,
        "draft_model": model.draft_model if drafter_needs_model(cfg.drafter.name) else None,
        "drafter": cfg.drafter.name,
        "gamma": cfg.drafter.gamma,
        "verifier": cfg.verifier.name,
        "verifier_setting": setting_string(settings),
        **conditions,
        "own_engine": own_engine(conditions["backend"]),
        "draft_length": cfg.drafter.length,
        "drafter_setting": spec.drafter_setting if spec is not None else "",
    }


def failure_record(
    cfg: Any,
    name: str,
    spec: MethodSpec | None,
    error: BaseException,
    question: Question | None = None,
    turn: int = 0,
    method: str = "*",
) -> Record:
    """A row saying what failed: one question's turn, or (question "*") the whole cell; ``spec``: the cell's method
    (``cell_keys``)."""
    return Record(
        **cell_keys(cfg, name, spec),
        question_id=question.question_id if question else "*",
        category=question.category if question else "",
        turn=turn,
        method=method,
        status="failed",
        error=f"{type(error).__name__}: {error}"[:2000],
    )


def batch_fields(number: int, turn: int, results: list[DecodeResult]) -> list[dict[str, Any]]:
    """The batch fields of the records of ``results``, decoded together as batch ``number`` (the
    questions' index // batch_size) at turn ``turn``: a batch's wall time is its last row's finish."""
    finish = [result.prefill_s + result.decode_s for result in results]
    batch = {"batch_id": f"{number}.{turn}", "batch_rows": len(results), "batch_s": max(finish)}
    return [{**batch, "finish_s": seconds} for seconds in finish]


def compare(tokens: list[int], baseline: list[int] | None) -> tuple[float | None, int | None]:
    """(share of positions equal to the baseline, first differing position or None)."""
    if baseline is None:
        return None, None
    same = [a == b for a, b in zip(tokens, baseline)]
    length = max(len(tokens), len(baseline), 1)
    divergence = same.index(False) if False in same else (None if len(tokens) == len(baseline) else len(same))
    return sum(same) / length, divergence


@dataclass(frozen=True)
class RowBuilder:
    """Builds a cell's records. keys: ``cell_keys`` of the cell's method; tokenizer: the target's (the
    answer's text); stop_strings: where answers are cut; shadows: the labels of the shadow verifiers."""

    keys: dict[str, Any]
    tokenizer: Any
    stop_strings: tuple[str, ...]
    shadows: tuple[str, ...]

    def copied_baseline(self, row: dict[str, Any]) -> Record:
        """A baseline row another cell of the sweep decoded, as this cell's record."""
        copied = {"baseline_from": row["baseline_from"] or row["cell"], "schema_version": SCHEMA_VERSION,
                  "rule_counts": {}, "rule_values": {}}  # a baseline verifies nothing  # fmt: skip
        kept = {key: value for key, value in row.items() if key in RECORD_FIELDS}  # older rows' retired fields go
        return Record(**{**kept, **self.keys, **copied})  # fields the cached row lacks take their defaults

    def record(self, question: Question, turn: int, method: PreparedMethod, prompt: list[int], result: DecodeResult,
               batch: dict[str, Any]) -> Record:  # fmt: skip
        """The record of one decoded turn; ``batch``: its batch fields (``batch_fields``)."""
        answer = cut_at_stop_string(self.tokenizer.decode(result.tokens, skip_special_tokens=True), self.stop_strings)
        phases = result.phase_seconds()
        accepted, reached = result.accepted_per_depth()
        reasons = [r for step in result.steps for r in step.reasons]
        return Record(
            **self.keys,
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
            engine_step_s=result.engine_step_s,
            engine_step_rows=result.engine_step_rows,
            shadow_accepted=dict(zip(self.shadows, result.shadow_accepted(len(self.shadows)))) if method.judged else {},
            rule_counts=result.rule_counts(),
            rule_values={name: [finite_or_none(float(v)) for v in found] for name, found in result.rule_values().items()},
            **self.fidelity_fields(method, result),
            verified_positions=len(reasons),
            reasons=reasons,
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

    def fidelity_fields(self, method: PreparedMethod, result: DecodeResult) -> dict[str, Any]:
        """The record's fidelity columns: per verifier label its summed costs, the time they took
        and the live verifier's costs per verified position (aligned with ``reasons``)."""
        measured = [step for step in result.steps if step.fidelity is not None]
        if not method.judged or not measured:
            return {}
        labels = [method.spec.verifier_label, *self.shadows]
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
