"""How long a cell has left, predicted from its own finished rows rather than from its token budget.

A row still to come is expected to be as long as the same question's answer by another method where one has
finished (answer lengths vary most between questions), else as the answers to that question measured before
(``measured_lengths.json``: the committed runs' answers of that model to that task, written by
``benchmarks/answer_lengths.py --write-lengths``), else as the mean of the finished answers of its turn, else
of all turns; never longer than the budget. Each method's rows are expected to take the wall seconds
per token its own finished rows took in this session (the gaps between finished rows: decoding, scoring and
writing, warm-ups left out), else their own decode seconds (a resumed run's kept rows), else the pooled
rates of every method, in that order. Nothing is predicted before the first answer finishes.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars_bench.bench.records import row_key

Key = tuple[str, int, str]  # (question, turn, method), as records.row_key
MEASURED_LENGTHS = Path(__file__).with_name("measured_lengths.json")


def length_key(question: str, turn: int) -> str:
    """A question's turn as ``measured_lengths.json`` names it: ``QUESTION:TURN``."""
    return f"{question}:{turn}"


def measured_lengths(model: str, task: str, path: Path = MEASURED_LENGTHS) -> dict[str, float]:
    """The mean new tokens of the answers to each turn of ``task``'s questions that ``model`` (a model option's name)
    gave in the committed runs, by ``length_key``; empty where none were measured."""
    table = json.loads(path.read_text()) if path.is_file() else {}
    return dict(table.get("lengths", {}).get(model, {}).get(task, {}))


@dataclass
class Tally:
    """Seconds spent on tokens: a rate's running sums."""

    seconds: float = 0.0
    tokens: float = 0.0

    def add(self, seconds: float, tokens: float) -> None:
        self.seconds, self.tokens = self.seconds + seconds, self.tokens + tokens


@dataclass
class Mean:
    """A running mean."""

    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total, self.count = self.total + value, self.count + 1

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class Forecast:
    """The finished rows of a cell whose ``planned`` rows decode up to ``budget`` new tokens each. Every lookup is
    a running sum, so that a cell of thousands of rows (a whole task) is forecast in time linear in its rows."""

    planned: list[Key]
    budget: int
    measured: dict[str, float] = field(default_factory=dict)  # measured_lengths' means, by length_key
    done: set[Key] = field(default_factory=set)  # every finished row (a failed one too), and the turns it ended
    by_question: dict[tuple[str, int], Mean] = field(default_factory=lambda: defaultdict(Mean))  # its answers' tokens
    by_turn: dict[int, Mean] = field(default_factory=lambda: defaultdict(Mean))  # the answers' tokens, per turn
    answers: Mean = field(default_factory=Mean)  # every finished answer's tokens
    wall: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))  # method -> wall seconds, tokens
    decoded: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))  # method -> its rows' own seconds

    def finish(self, row: Mapping[str, Any], wall_s: float | None) -> None:
        """A finished row; ``wall_s``: the wall seconds it took since the rows before it finished (None for a kept
        row). A failed turn ends its question for that method: the later turns are not coming."""
        key = row_key(row)
        self.done.add(key)
        if row["status"] != "ok":
            self.done.update(k for k in self.planned if k[0] == key[0] and k[2] == key[2] and k[1] > key[1])
            return
        tokens = min(int(row["new_tokens"]), self.budget)
        for mean in (self.by_question[key[:2]], self.by_turn[key[1]], self.answers):
            mean.add(tokens)
        self.decoded[key[2]].add(row["prefill_s"] + row["decode_s"], tokens)
        if wall_s is not None:
            self.wall[key[2]].add(wall_s, tokens)

    def expected_tokens(self, key: Key) -> float | None:
        """The new tokens row ``key`` is expected to decode; None before any answer finished."""
        same_question = self.by_question.get(key[:2], Mean()).value
        if same_question is not None:
            return same_question
        measured = self.measured.get(length_key(*key[:2]))
        if measured is not None:
            return min(measured, self.budget)
        same_turn = self.by_turn.get(key[1], Mean()).value
        return same_turn if same_turn is not None else self.answers.value

    def seconds_per_token(self, method: str) -> float | None:
        """The wall seconds a token of ``method`` is expected to take; None before any answer finished."""
        pooled = [Tally(sum(t.seconds for t in spent.values()), sum(t.tokens for t in spent.values()))
                  for spent in (self.wall, self.decoded)]  # fmt: skip
        for tally in (self.wall.get(method), self.decoded.get(method), *pooled):
            if tally is not None and tally.tokens:
                return tally.seconds / tally.tokens
        return None

    def coming(self) -> list[Key]:
        """The planned rows not finished yet."""
        return [key for key in self.planned if key not in self.done]

    def tokens_left(self) -> float | None:
        """The new tokens the rows still to come are expected to decode (None: not known yet)."""
        expected = [self.expected_tokens(key) for key in self.coming()]
        return None if None in expected else sum(expected)  # type: ignore[arg-type]

    def seconds_left(self) -> float | None:
        """The wall seconds the rows still to come are expected to take, from the last finished row on."""
        rates = {method: self.seconds_per_token(method) for method in {key[2] for key in self.planned}}
        total = 0.0
        for key in self.coming():
            tokens, rate = self.expected_tokens(key), rates[key[2]]
            if tokens is None or rate is None:
                return None
            total += tokens * rate
        return total

    def questions_done(self) -> int:
        """How many questions have every planned row finished."""
        rows: dict[str, list[bool]] = defaultdict(list)
        for key in self.planned:
            rows[key[0]].append(key in self.done)
        return sum(all(finished) for finished in rows.values())


def minutes(seconds: float) -> str:
    """``seconds`` as a person reads a duration: ``45 s``, ``4 min 10 s``, ``1 h 12 min``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def forecast_of(planned: Iterable[Key], budget: int, kept: Iterable[Mapping[str, Any]],
                measured: Mapping[str, float] | None = None) -> Forecast:  # fmt: skip
    """A cell's forecast, with the rows a resumed run kept counted as finished; ``measured``: ``measured_lengths``."""
    forecast = Forecast(list(planned), budget, dict(measured or {}))
    for row in kept:
        forecast.finish(row, None)
    return forecast


def error_pct(predicted: float, took: float) -> float:
    """How far ``predicted`` seconds were from the ``took`` seconds, in percent of ``took`` (signed)."""
    return 100.0 * (predicted - took) / took if took > 0 else math.nan
