"""What the engine records per step and per decoded sequence (raw counters, seconds)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mars_bench.decoding.fidelity import PositionCosts, sequence_costs

PHASES = ("draft", "target", "verify", "bookkeeping")  # the parts of a step's seconds


@dataclass
class StepRecord:
    """One draft -> target forward -> verify -> commit step. Times in seconds."""

    drafted: int
    accepted: int
    relaxed: int
    next_token: int
    emitted: int  # tokens committed by this step after stop / budget cuts
    reasons: list[int] = field(default_factory=list)  # Reason code per visited depth
    # the verifier's declared statistics (verification.base.Statistic) per visited depth: counts as flags (did it
    # happen there), values as numbers; empty for a verifier that declares none (and for the baseline)
    flags: dict[str, list[bool]] = field(default_factory=dict)
    values: dict[str, list[float]] = field(default_factory=dict)
    shadow_accepted: list[int] = field(default_factory=list)  # drafts each shadow verifier would keep, in order
    fidelity: list[PositionCosts] | None = None  # with fidelity on: the live verifier's costs, then each shadow's
    fidelity_s: float = 0.0  # seconds spent on ``fidelity`` (not part of the method's time)
    draft_s: float = 0.0
    target_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0


@dataclass
class DecodeResult:
    """One prompt decoded. ``tokens``: new token ids, cut at the first stop token
    (kept) and at max_new_tokens. The first token comes from the prefill forward; every
    later token from a verification step."""

    prompt_len: int
    tokens: list[int]
    steps: list[StepRecord]
    prefill_s: float
    decode_s: float
    stop_reason: str  # stop_token | stop_string | max_new_tokens
    # a serving engine's own steps that served this prompt after its prefill (backend=vllm; empty for this
    # package's engine, whose steps are timed by phase): each one's wall seconds and the requests it served
    engine_step_s: list[float] = field(default_factory=list)
    engine_step_rows: list[int] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of prefill and decode together (the rate every table uses)."""
        return self.new_tokens / (self.prefill_s + self.decode_s)

    @property
    def verify_steps(self) -> int:
        return len(self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens per target verification forward (prefill and its token excluded)."""
        steps = self.verify_steps
        return sum(step.emitted for step in self.steps) / steps if steps else float("nan")

    @property
    def drafted(self) -> int:
        return sum(step.drafted for step in self.steps)

    @property
    def accepted(self) -> int:
        return sum(step.accepted for step in self.steps)

    @property
    def relaxed(self) -> int:
        return sum(step.relaxed for step in self.steps)

    def rule_counts(self) -> dict[str, int]:
        """Per count statistic the verifier declares, the verified positions where it happened (empty for a
        verifier that declares none, and for the baseline, which verifies nothing)."""
        counts: dict[str, int] = {}
        for step in self.steps:
            for name, flags in step.flags.items():
                counts[name] = counts.get(name, 0) + sum(flags)
        return counts

    def rule_values(self) -> dict[str, list[float]]:
        """Per value statistic the verifier declares, its value at every verified position, in order (aligned
        with the steps' ``reasons``)."""
        values: dict[str, list[float]] = {}
        for step in self.steps:
            for name, found in step.values.items():
                values.setdefault(name, []).extend(found)
        return values

    def accepted_per_depth(self) -> tuple[list[int], list[int]]:
        """(accepted at depth d, reached depth d) for d = 0, 1, ... (alpha_d = ratio), up to the
        deepest depth any step judged (a tree's node count is not its depth)."""
        depth = max((len(step.reasons) for step in self.steps), default=0)
        accepted, reached = [0] * depth, [0] * depth
        for step in self.steps:
            for d in range(len(step.reasons)):
                reached[d] += 1
                accepted[d] += d < step.accepted
        return accepted, reached

    def shadow_accepted(self, count: int) -> list[list[int]]:
        """Per shadow verifier (``count`` of them, in order): drafts it would keep at each step
        (0 at a step with no drafts), aligned with the steps' ``accepted``."""
        return [[step.shadow_accepted[index] if step.drafted else 0 for step in self.steps] for index in range(count)]

    def fidelity(self) -> list[dict[str, float | int | None]]:
        """Per verifier judged with fidelity on (the live one, then each shadow): its costs summed
        over the steps that verified drafts (``decoding/fidelity.py``); empty with fidelity off."""
        measured = [step.fidelity for step in self.steps if step.fidelity is not None]
        count = len(measured[0]) if measured else 0
        return [sequence_costs([costs[index] for costs in measured]) for index in range(count)]

    @property
    def fidelity_s(self) -> float:
        return sum(step.fidelity_s for step in self.steps)

    def phase_seconds(self) -> dict[str, float]:
        return {phase: sum(getattr(step, f"{phase}_s") for step in self.steps) for phase in PHASES}
