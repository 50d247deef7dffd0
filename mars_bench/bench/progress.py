"""A cell's progress bar, counted in generated tokens.

It moves while a row (one turn of one method) is decoded, after every verification step, by the
engine's ``on_tokens`` call, whose time is left out of the method's; as the row ends it settles on the
row's new tokens. Its total is every planned row's ``max_new_tokens``, lowered as a row ends short of it
(a stop token, a failure), so that it reaches exactly the tokens generated. The postfix gives, over the
rows finished so far, each method's throughput and the speculative method's tau, pooled as the summary
pools them (``bench/summary.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from mars_bench.bench.records import BASELINE
from mars_bench.decoding.tally import DecodeTally


class TokenProgress:
    """tqdm over a cell's tokens: ``planned`` rows of up to ``max_new_tokens`` each, ``kept`` rows (a
    resumed run's) counted from the start; ``disable`` (``progress=false``) keeps it silent."""

    def __init__(self, planned: int, max_new_tokens: int, kept: Iterable[Mapping[str, Any]], *, desc: str, disable: bool):
        from tqdm import tqdm

        self.max_new_tokens = max_new_tokens
        self.totals: dict[str, DecodeTally] = {}  # method -> its finished rows
        self.in_flight = 0  # tokens shown so far of the row being decoded
        total, done = planned * max_new_tokens, 0
        for row in kept:
            tokens = self.take(row)
            total, done = total - (max_new_tokens - tokens), done + tokens
        # initial: the kept tokens, which tqdm leaves out of this session's rate
        self.bar = tqdm(total=total, initial=done, unit="tok", desc=desc, disable=disable, dynamic_ncols=True)
        self.show()

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
            self.bar.update(ahead)

    def add(self, row: Mapping[str, Any]) -> None:
        """A row just finished: the bar stands at its tokens, and its total drops by the budget it left unused."""
        tokens = self.take(row)
        self.bar.total -= self.max_new_tokens - tokens
        self.bar.update(tokens - self.in_flight)  # back, for a failed row, by what it had shown
        self.in_flight = 0
        self.show()

    def show(self) -> None:
        parts = []
        for method, tally in self.totals.items():
            rate, tau = tally.tokens_per_s, tally.tau
            text = method if math.isnan(rate) else f"{method} {rate:.1f} tok/s"
            parts.append(text + ("" if method == BASELINE or math.isnan(tau) else f" tau {tau:.2f}"))
        self.bar.set_postfix_str(", ".join(parts))

    def close(self) -> None:
        self.bar.total = self.bar.n  # turns never decoded (after a failed turn) are not coming
        self.bar.refresh()
        self.bar.close()

    def __enter__(self) -> TokenProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # interrupted: leave the bar where it stopped
            self.bar.close()
