"""A cell's progress bar, counted in generated tokens.

It moves as each row (one turn of one method) is decoded, by the row's new tokens: the engine's
decode loop is left alone, so the timed decode carries no progress work. Its total is every planned
row's ``max_new_tokens``, lowered as a row ends short of it (a stop token, a failure), so that it
reaches exactly the tokens generated. The postfix gives, so far, each method's throughput and the
speculative method's tau, pooled as the summary pools them (``bench/summary.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mars_bench.bench.records import BASELINE


@dataclass
class MethodTotals:
    """One method's finished rows so far: tokens, seconds (prefill + decode) and verification steps."""

    new_tokens: int = 0
    seconds: float = 0.0
    emitted: int = 0  # tokens after the prefill's one, the ones verification steps produced
    steps: int = 0

    def add(self, row: Mapping[str, Any]) -> None:
        self.new_tokens += row["new_tokens"]
        self.seconds += row["prefill_s"] + row["decode_s"]
        self.emitted += max(row["new_tokens"] - 1, 0)
        self.steps += row["steps"]

    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds else None

    def tau(self) -> float | None:
        return self.emitted / self.steps if self.steps else None


class TokenProgress:
    """tqdm over a cell's tokens: ``planned`` rows of up to ``max_new_tokens`` each, ``kept`` rows (a
    resumed run's) counted from the start; ``disable`` (``progress=false``) keeps it silent."""

    def __init__(self, planned: int, max_new_tokens: int, kept: Iterable[Mapping[str, Any]], *, desc: str, disable: bool):
        from tqdm import tqdm

        self.max_new_tokens = max_new_tokens
        self.totals: dict[str, MethodTotals] = {}
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
        self.totals.setdefault(row["method"], MethodTotals()).add(row)
        return min(row["new_tokens"], self.max_new_tokens)

    def add(self, row: Mapping[str, Any]) -> None:
        """A row just decoded: the bar moves on by its tokens, and its total drops by the budget it left unused."""
        tokens = self.take(row)
        self.bar.total -= self.max_new_tokens - tokens
        self.bar.update(tokens)
        self.show()

    def show(self) -> None:
        parts = []
        for method, totals in self.totals.items():
            rate, tau = totals.tokens_per_s(), totals.tau()
            text = f"{method} {rate:.1f} tok/s" if rate is not None else method
            parts.append(text + (f" tau {tau:.2f}" if method != BASELINE and tau is not None else ""))
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
