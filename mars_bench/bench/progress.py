"""A cell's progress bar, counted in generated tokens.

It moves while a row (one turn of one method) is decoded, after every verification step, by the
engine's ``on_tokens`` call, whose time is left out of the method's; as the row ends it settles on the
row's new tokens. Its total is the tokens the cell is expected to decode (``bench/duration.py``: the answer
lengths measured before, then the finished answers'), or, where none is known yet, every planned row's
``max_new_tokens`` lowered as a row ends short of it; at the end it is exactly the tokens generated. The
postfix gives, over the rows finished so far, each method's throughput and the speculative method's tau,
pooled as the summary pools them (``bench/summary.py``), and the time left as ``bench/duration.py`` predicts
it (tqdm's own estimate, from the rate of the tokens so far, is not shown). The first two questions done, one
line says what the whole cell is expected to take; at the end, one line sets that beside what it took.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from mars_bench.bench.duration import Key, error_pct, forecast_of, minutes
from mars_bench.bench.records import BASELINE
from mars_bench.decoding.tally import DecodeTally

FIRST_QUESTIONS = 2  # questions done before the cell's whole duration is stated
LONG_CELL_TOKENS = 2_000  # a cell that may decode more points to a short look first
SHORT_LOOK = "python -m mars_bench experiment=smoke"
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"  # tqdm's, without its estimate


class TokenProgress:
    """tqdm over a cell's tokens: the ``planned`` rows' keys, each row up to ``max_new_tokens``, ``kept`` rows (a
    resumed run's) counted from the start; ``disable`` (``progress=false``) keeps it and its lines silent;
    ``measured``: the answer lengths measured before (``duration.measured_lengths``)."""

    pointed = False  # the short look was named: once a process (a sweep's cells run in one)

    def __init__(self, planned: list[Key], max_new_tokens: int, kept: Iterable[Mapping[str, Any]], *, desc: str,
                 disable: bool, measured: Mapping[str, float] | None = None):  # fmt: skip
        from tqdm import tqdm

        kept = list(kept)
        self.max_new_tokens, self.disable = max_new_tokens, disable
        self.totals: dict[str, DecodeTally] = {}  # method -> its finished rows
        self.in_flight = 0  # tokens shown so far of the row being decoded
        self.forecast = forecast_of(planned, max_new_tokens, kept, measured)
        self.started = self.last = time.monotonic()  # the cell's start; the last finished row (or begin)
        self.questions_done = self.forecast.questions_done()
        self.questions = len({key[0] for key in planned})
        self.predicted: float | None = None  # the cell's whole seconds, as predicted once its first questions were done
        self.left = self.forecast.seconds_left()  # from the last finished row on (None: not known yet)
        total, done = len(planned) * max_new_tokens, 0
        for row in kept:
            tokens = self.take(row)
            total, done = total - (max_new_tokens - tokens), done + tokens
        budget, expected = total - done, self.forecast.tokens_left()
        # initial: the kept tokens, which tqdm leaves out of this session's rate
        self.bar = tqdm(total=total if expected is None else done + round(expected), initial=done, unit="tok", desc=desc,
                        disable=disable, dynamic_ncols=True, bar_format=BAR_FORMAT)  # fmt: skip
        if budget > LONG_CELL_TOKENS:
            about = "" if expected is None else f", about {round(expected)} expected"
            look = "" if TokenProgress.pointed else f" (a 1-minute look: {SHORT_LOOK})"
            TokenProgress.pointed = TokenProgress.pointed or not disable
            self.say(f"up to {budget} new tokens to decode{about}; the bar gives the time left once the first answer "
                     f"is in{look}")  # fmt: skip
        self.show()

    def say(self, line: str) -> None:
        """One line above the bar (none where the bar is off)."""
        if not self.disable:
            self.bar.write(f"mars_bench: {line}", file=sys.stderr)

    def begin(self) -> None:
        """The cell's rows start decoding now (after a warm-up, whose time no row's speed should count)."""
        self.last = time.monotonic()

    def take(self, row: Mapping[str, Any]) -> int:
        """Count a finished row in its method's totals; returns its new tokens (0 for a failed row)."""
        if row["status"] != "ok":
            return 0
        seconds = row["prefill_s"] + row["decode_s"]
        self.totals.setdefault(row["method"], DecodeTally()).count(row["new_tokens"], seconds, row["steps"], row["drafted"],
                                                                   row["accepted"])  # fmt: skip
        return min(row["new_tokens"], self.max_new_tokens)

    def tick(self, new_tokens: int) -> None:
        """The row being decoded has ``new_tokens`` so far (a decode timed again starts from 0: the bar waits)."""
        ahead = min(new_tokens, self.max_new_tokens) - self.in_flight
        if ahead > 0:
            self.in_flight += ahead
            if self.left is not None:
                self.show()
            self.bar.total = max(self.bar.total, self.bar.n + ahead)  # a row longer than expected
            self.bar.update(ahead)

    def add(self, row: Mapping[str, Any]) -> None:
        """A row just finished (a batch of one)."""
        self.add_batch([row])

    def add_batch(self, rows: list[Mapping[str, Any]]) -> None:
        """The rows of a batch just finished together: the bar stands at their tokens, their wall time is shared
        between them by their tokens, and the total is what the rows to come are expected to add."""
        now = time.monotonic()
        wall, self.last = now - self.last, now
        counts = [self.take(row) for row in rows]
        counted = sum(counts)
        for row, tokens in zip(rows, counts):
            self.forecast.finish(row, wall * tokens / counted if counted else 0.0)
            self.bar.total -= self.max_new_tokens - tokens
            self.bar.update(tokens - self.in_flight)  # back, for a failed row, by what it had shown
            self.in_flight = 0
        if self.disable:  # nothing shown: nothing to predict
            return
        expected = self.forecast.tokens_left()
        if expected is not None:
            self.bar.total = max(self.bar.n, self.bar.n + round(expected))
        self.left = self.forecast.seconds_left() if self.forecast.coming() else None
        self.show()
        questions_done, questions = self.forecast.questions_done(), self.questions
        if self.questions_done < FIRST_QUESTIONS <= questions_done < questions and self.left is not None:
            elapsed, left = now - self.started, self.left
            self.predicted = elapsed + left
            self.say(f"{questions_done} of {questions} prompts done, {minutes(elapsed)} into this run; about "
                     f"{minutes(left)} left, {minutes(self.predicted)} in all (from the answer lengths and the speeds "
                     "so far)")  # fmt: skip
        self.questions_done = questions_done

    def show(self, *, final: bool = False) -> None:
        """The postfix: each method's speed (and tau), then the time left (not once the cell is done)."""
        parts = []
        for method, tally in self.totals.items():
            rate, tau = tally.tokens_per_s, tally.tau
            text = method if math.isnan(rate) else f"{method} {rate:.1f} tok/s"
            parts.append(text + ("" if method == BASELINE or math.isnan(tau) else f" tau {tau:.2f}"))
        if self.left is not None and not final:
            parts.append(f"about {minutes(self.left - (time.monotonic() - self.last))} left")
        self.bar.set_postfix_str(", ".join(parts), refresh=False)

    def close(self) -> None:
        self.bar.total = self.bar.n  # turns never decoded (after a failed turn) are not coming
        self.show(final=True)
        self.bar.refresh()
        self.bar.close()
        if self.predicted is not None and not self.forecast.coming():
            took = time.monotonic() - self.started
            self.say(f"the cell took {minutes(took)} in this run; predicted {minutes(self.predicted)} once "
                     f"{FIRST_QUESTIONS} prompts were done ({error_pct(self.predicted, took):+.0f}%)")  # fmt: skip

    def __enter__(self) -> TokenProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # interrupted: leave the bar where it stopped
            self.bar.close()
