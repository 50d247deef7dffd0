"""Decodes added up, as a progress bar's postfix and an end-of-run line show them: tokens per second, and
tau pooled as the app's tables pool it (tokens emitted by verification steps over those steps)."""

from __future__ import annotations

from dataclasses import dataclass

from mars_bench.common.token_counts import emitted_tokens
from mars_bench.decoding.trace import DecodeResult


@dataclass
class DecodeTally:
    """Decodes added up: requests (decoded turns), new tokens, seconds (prefill and decode), verification
    steps and the tokens they emitted (all new tokens but the prefill's), drafts made and kept."""

    requests: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0

    def count(self, new_tokens: int, seconds: float, steps: int, drafted: int, accepted: int) -> None:
        """One more decode (a DecodeResult's or a record's numbers)."""
        self.requests += 1
        self.new_tokens += new_tokens
        self.seconds += seconds
        self.steps += steps
        self.emitted += emitted_tokens(new_tokens)
        self.drafted += drafted
        self.accepted += accepted

    def add(self, result: DecodeResult) -> None:
        self.count(result.new_tokens, result.prefill_s + result.decode_s, result.verify_steps, result.drafted, result.accepted)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    @property
    def tau(self) -> float:
        """Tokens per verification step, pooled over the requests (as the app's tables pool it)."""
        return self.emitted / self.steps if self.steps else float("nan")

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    def postfix(self) -> str:
        return f"{self.tokens_per_s:.1f} tok/s, tau {self.tau:.2f}"

    def line(self) -> str:
        return (f"mars_bench: {self.requests} requests, {self.new_tokens} new tokens in {self.seconds:.1f} s "
                f"({self.tokens_per_s:.2f} tok/s), tau {self.tau:.2f}, acceptance {self.acceptance:.3f} "
                f"({self.accepted} of {self.drafted} drafts kept)")  # fmt: skip
