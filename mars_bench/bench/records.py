"""Tidy records: one JSON line per (question, turn, method), appended and flushed per row.

Rerunning a cell into the same folder skips the rows already present (resume). A run
killed mid-write leaves at most one partial last line, which is cut off on reopening. The
cell holds a method's rows back only until its baseline rows for the same question exist
(to compare outputs), so a kill loses at most the question in flight.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mars_bench.common.kernels import EARLIER_KERNELS
from mars_bench.common.reasons import Reason

RECORDS_FILE = "records.jsonl"
MANIFEST_FILE = "manifest.json"  # beside it: the run's versions, placement and each method's settings
BASELINE = "baseline"  # the ``method`` of the autoregressive baseline rows
BUDGET = "max_new_tokens"  # the ``stop_reason`` of an answer cut at the token budget (it did not finish)
SCHEMA_VERSION = 16  # 2: shadow_accepted, baseline_from, draft_length; 3: drafter_setting;
# 4: verifier_setting, trigger_count from the verifier's own rule (None where it has none);
# 5: fidelity (per verifier: exact acceptance, KL and TV against the target), fidelity_s, position_*;
# 6: other_cpu_s, other_load, other_gpu_util, disturbed, retimed (contention while the row was timed);
# 7: attn_implementation, device_map, scorer, threads (with the others, every one of BASELINE_CONDITIONS);
#    the live verifier's settings no longer written as fields of their own beside verifier_setting (schema 6 and
#    older wrote the paper rule's two there, for every verifier; verifier_setting holds every verifier's)
# 8: batch_size (a baseline condition), batch_id, batch_rows, batch_s, finish_s (rows decoded B at a time)
# 9: step_drafted, step_draft_s, step_target_s (per step: what the cost model at batch B needs, analysis/batching.py),
#    peak_memory_mb
# 10: finished (the answer ended on a stop token or string, not at the token budget)
# 11: backend (what ran the method: the engine of this package, transformers, or another backend)
# 12: kernels (model.kernels: how the engine's linear layers computed on the CPU)
# 13: engine_step_s, engine_step_rows (a serving engine's own steps: what the cost model reads for backend=vllm)
# 14: own_engine (the backend's Backend.own_engine: this package's engine decoded the row; ``own_engine`` reads older rows)
# 15: judge (a safety scorer's judge, a baseline condition), safety (its verdicts, and against the baseline: refusal_kept)
# 16: rule_counts, rule_values (the statistics the verifier declares, by their names) in place of trigger_count,
#     nonpositive_top1 and margins (``rule_statistics`` reads older rows)
SETTINGS_AS_FIELDS_UNTIL = 6  # the last schema whose rows carried verifier settings as fields (``legacy_setting_fields``)
OLD_RULE_FIELDS = ("trigger_count", "nonpositive_top1", "margins")  # retired by schema 16; ``rule_statistics`` reads them
RETIRED_LATER = OLD_RULE_FIELDS  # the fields retired after schema 7, which no reader takes for verifier settings

# What fixes a baseline's output, its score and its timing conditions besides its prompt: config keys
# that every record carries under these names. Rows that agree on them (and on question and turn) have
# one baseline: bench/baseline_cache.py hashes them, with the prompt's token ids and seed, to share it
# between the cells of a sweep; the analysis pairs a method with a baseline, and pools rows into one
# setting, only where they agree (records older than schema 7 lack the last four: they agree as unknown).
BASELINE_CONDITIONS = ("target", "dtype", "attn_implementation", "device_map", "task", "scorer", "temperature", "top_p",
                       "top_k", "max_new_tokens", "seed", "threads", "batch_size", "backend", "kernels", "judge")  # fmt: skip
# (batch_size from schema 8 on: older rows were decoded one at a time, batch_size 1; backend from schema 11 on;
# kernels from schema 12 on: older rows ran common.kernels.EARLIER_KERNELS; judge from schema 15 on: older rows had none)
EARLIER_BACKEND = "transformers"  # what ran every row, and every config, older than the backend field


@dataclass
class Record:
    """One decoded turn. Times in seconds; token counts are generated ids, never re-tokenised."""

    # the cell
    cell: str
    model: str
    target: str
    draft_model: str | None
    drafter: str
    gamma: int  # drafts per step (the starting value under an adaptive draft length)
    verifier: str
    verifier_setting: str  # the verifier's settings as key=value pairs (common.settings.setting_string)
    temperature: float
    top_p: float
    top_k: int
    task: str
    seed: int
    max_new_tokens: int
    dtype: str
    attn_implementation: str
    device_map: str | None
    scorer: str | None
    threads: int | None  # torch CPU threads; None: all cores
    batch_size: int  # prompts decoded together (the configured B; a batch may hold fewer: batch_rows)
    # the row
    question_id: int | str
    category: str
    turn: int
    method: str  # "baseline" or the verifier's name
    status: str = "ok"
    error: str | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    tau: float | None = None
    drafted: int = 0
    accepted: int = 0
    relaxed: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    reached_per_depth: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)
    step_drafted: list[int] = field(default_factory=list)  # drafts judged per step (aligned with step_accepted)
    # seconds of each step's drafting and target forward; at batch B they are the batch's step, shared by its rows
    step_draft_s: list[float] = field(default_factory=list)
    step_target_s: list[float] = field(default_factory=list)
    # backend=vllm: seconds of each of vLLM's engine steps that served the turn after its prefill (schedule, forward,
    # verification, drafting: the whole step) and the requests each served; empty for this package's engine
    engine_step_s: list[float] = field(default_factory=list)
    engine_step_rows: list[int] = field(default_factory=list)
    shadow_accepted: dict[str, list[int]] = field(default_factory=dict)  # shadow verifier -> drafts kept per drafting step
    # the statistics the live verifier declares (verification.base.Statistic), by name: per count statistic, the
    # verified positions where it happened; per value statistic, its value per verified position (aligned with
    # ``reasons``; None where not finite). Empty for a verifier that declares none, and for the baseline.
    rule_counts: dict[str, int] = field(default_factory=dict)
    rule_values: dict[str, list[float | None]] = field(default_factory=dict)
    # fidelity=true: per verifier label (the live one first, then each shadow), its costs summed over the
    # sequence (decoding/fidelity.py: positions, accept, kl, tv, draft_tv, expected_accepted, judged, ...)
    fidelity: dict[str, dict[str, Any]] = field(default_factory=dict)
    fidelity_s: float = 0.0  # seconds spent measuring fidelity, not part of decode_s
    position_accept: list[float] = field(default_factory=list)  # the live verifier's alpha_V per verified position
    position_kl: list[float | None] = field(default_factory=list)  # KL(P_V || p) per verified position (empty: greedy)
    position_tv: list[float] = field(default_factory=list)  # TV(P_V, p) per verified position
    verified_positions: int = 0
    # Reason code per verified position: per step, its accepted depths', then REJECTED where a draft was rejected
    # (``relaxed_positions`` reads the answer positions of the relaxed tokens from them and ``step_accepted``)
    reasons: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    tokens_per_s: float = 0.0
    # the row's batch (batch_size 1: the row alone): "chunk.turn", the chunk being the questions' index // batch_size
    batch_id: str = ""
    batch_rows: int = 1  # rows decoded in the batch (fewer than batch_size at the last chunk, or at a later turn)
    batch_s: float = 0.0  # the batch's wall time, from its prefill to its last row's last token
    finish_s: float = 0.0  # from the batch's start to this row's last token: its latency (prefill_s + decode_s)
    other_cpu_s: float | None = None  # CPU seconds other processes used while this row was timed (None: not measurable)
    other_load: float | None = None  # the cores they kept busy on average (bench/contention.py)
    other_gpu_util: float | None = None  # the largest GPU multiprocessor share (percent) another process had
    peak_memory_mb: float | None = None  # the process's peak memory while the row (its batch) was timed, weights included
    disturbed: bool = False  # timed while others used more than the run's thresholds: left out of speedups by default
    retimed: int = 0  # how often this row was decoded again because its timing was disturbed (retry_disturbed)
    stop_reason: str = ""  # stop_token | stop_string | max_new_tokens (BUDGET)
    finished: bool | None = None  # ended on a stop token or stop string; False: cut at max_new_tokens (None: schema < 10)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    agreement: float | None = None  # share of positions equal to the baseline's output
    first_divergence: int | None = None  # first position differing from the baseline; None if identical
    baseline_rouge_l: float | None = None  # ROUGE-L F of this answer against the baseline's answer
    score: float | None = None
    baseline_from: str | None = None  # baseline rows reused from another cell: the cell that decoded them
    draft_length: str = "fixed"  # the draft-length policy: fixed | schedule | confidence
    drafter_setting: str = ""  # the drafter's shaping keys, e.g. "gamma=5,top_k=3,tree_tokens=16"
    backend: str = EARLIER_BACKEND  # what ran the method (mars_bench/backends); older rows: EARLIER_BACKEND
    # the backend's Backend.own_engine: this package's engine decoded (its steps are the forwards batch_costs.json times)
    own_engine: bool = True
    kernels: str = EARLIER_KERNELS  # model.kernels (common/kernels.py); older rows: EARLIER_KERNELS
    judge: str | None = None  # a safety scorer's judge as records name it (tasks/safety/judges.judge_label); None: none
    # a safety scorer's verdicts: {"judge": the chosen one, "verdicts": {judge: its verdict}}, and on a method row
    # paired with its baseline "refusal_kept" (tasks/safety/scoring.paired_safety); empty for other scorers
    safety: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @property
    def key(self) -> tuple[str, int, str]:
        return (str(self.question_id), self.turn, self.method)


RECORD_FIELDS = frozenset(item.name for item in fields(Record))  # every field a record of this schema has


def legacy_setting_fields(row: Mapping[str, Any]) -> list[str]:
    """The fields of ``row`` that hold the live verifier's settings as fields of their own, in row order: in a
    row of schema ``SETTINGS_AS_FIELDS_UNTIL`` or older, every field that no Record declares now (its writers
    put the paper rule's settings there, for every verifier, None where it had none); none in a newer row.
    A reader takes them from the row itself, so that no setting's name is written down outside its verifier."""
    if row.get("schema_version", 1) > SETTINGS_AS_FIELDS_UNTIL:
        return []
    return [name for name in row if name not in RECORD_FIELDS and name not in RETIRED_LATER]


def decoded_by_own_engine(row: Mapping[str, Any]) -> bool:
    """Whether this package's engine decoded ``row``: its ``own_engine`` field; in a row older than the field
    (schema 13 and before), whether its backend was ``EARLIER_BACKEND``, the one backend that ran this engine
    then (a ``vllm`` row reads False)."""
    return bool(row["own_engine"]) if "own_engine" in row else row.get("backend", EARLIER_BACKEND) == EARLIER_BACKEND


RULE_STATISTICS_FROM = 15  # the first schema whose rows carry rule_counts and rule_values


def rule_statistics(row: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, list[float | None]]]:
    """``row``'s verifier statistics by name: its ``rule_counts`` and ``rule_values``. The one place that reads rows
    older than ``RULE_STATISTICS_FROM``: their writers kept, for every verifier, the margin z2 / z1 per verified
    position (``margins``) and the positions with z1 <= 0 (``nonpositive_top1``), and the trigger count of a
    verifier with a trigger (``trigger_count``, None otherwise): here the statistics ``margin``,
    ``nonpositive_top1`` and ``trigger`` that the margin rules declare now."""
    if row.get("schema_version", 1) >= RULE_STATISTICS_FROM:
        counts, values = row.get("rule_counts"), row.get("rule_values")
        return dict(counts) if isinstance(counts, Mapping) else {}, dict(values) if isinstance(values, Mapping) else {}
    counts: dict[str, int] = {}
    values: dict[str, list[float | None]] = {}
    if present(row.get("trigger_count")):
        counts["trigger"] = int(row["trigger_count"])
    if present(row.get("nonpositive_top1")) and row.get("verified_positions"):
        counts["nonpositive_top1"] = int(row["nonpositive_top1"])
    margins = row.get("margins")
    if isinstance(margins, (list, tuple)) and margins:
        values["margin"] = [float(value) if present(value) and math.isfinite(value) else None for value in margins]
    return counts, values


def relaxed_positions(row: Mapping[str, Any]) -> list[int] | None:
    """The answer positions (generated index: 0 is the answer's first token) of the tokens that a lossy rule
    relaxed into ``row``'s answer: its accepted drafts whose reason is ``Reason.RELAXED``, read from the step trace.

    The layout read: the answer's first token comes from the prefill; each verification step then emits its
    accepted drafts and one token more (the bonus or correction), so step s's drafts start at position
    1 + the sum of (accepted + 1) over the steps before it. ``reasons`` holds per step the codes of its accepted
    depths, in order, then REJECTED where a draft was rejected: its codes other than REJECTED are the accepted
    drafts, ``step_accepted[s]`` of them for step s. A stop or the budget cuts only the last step, so positions at
    or past ``new_tokens`` were never emitted and are left out. Empty for a row without steps (a baseline); None
    where the trace does not hold a code for every accepted draft (a backend that recorded none)."""
    accepted = [int(count) for count in listed(row.get("step_accepted"))]
    codes = [int(code) for code in listed(row.get("reasons")) if int(code) != Reason.REJECTED]
    if len(codes) != sum(accepted):
        return None
    positions, start, at = [], 1, 0
    for count in accepted:
        positions += [start + depth for depth in range(count) if codes[at + depth] == Reason.RELAXED]
        start, at = start + count + 1, at + count
    return [position for position in positions if position < int(row.get("new_tokens") or 0)]


def listed(value: Any) -> list[Any]:
    """A per-step or per-position field read back as a list (a table may hold an array; a missing one: empty)."""
    return list(value) if isinstance(value, (list, tuple)) or hasattr(value, "tolist") else []


def present(value: Any) -> bool:
    """Whether a field read back holds a value (not None, not a table's NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def row_key(row: dict[str, Any]) -> tuple[str, int, str]:
    return (str(row["question_id"]), int(row["turn"]), str(row["method"]))


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete row of a records file (a partial last line is skipped)."""
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.endswith("\n"):
                yield json.loads(line)


def drop_partial_tail(path: Path) -> None:
    """Cut a partial last line (left by a process killed mid-write) off a JSON Lines file."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


class RecordWriter:
    """Append-only JSON Lines writer that knows which rows exist already."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / RECORDS_FILE
        drop_partial_tail(self.path)
        self.rows: dict[tuple[str, int, str], dict[str, Any]] = {row_key(row): row for row in read_rows(self.path)}

    def has(self, key: tuple[str, int, str]) -> bool:
        return key in self.rows

    def write(self, record: Record) -> dict[str, Any]:
        return self.write_many([record])[0]

    def write_many(self, records: list[Record]) -> list[dict[str, Any]]:
        """Append ``records`` in one write and one flush (a batch's rows: together or, killed, a partial last line)."""
        rows = [asdict(record) for record in records]
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows))
            handle.flush()
            os.fsync(handle.fileno())
        for record, row in zip(records, rows):
            self.rows[record.key] = row
        return rows
