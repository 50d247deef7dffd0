"""``mentored``: the largest acceptance whose output stays within KL(P_V || p) <= D of the target,
per position: mentored decoding (Tran-Thien, "An optimal lossy variant of speculative decoding",
2023). Its optimum emits pi = p * clip(q / p, lo, hi) for two constants lo <= 1 <= hi, found here
so that pi sums to 1 and KL(pi || p) = D (pi = q where KL(q || p) <= D already), then
rejection-samples toward pi. The original bounds KL(p || pi); this harness measures, and so
bounds, KL(P_V || p); the optimum has the same clipped form for either direction.

The constants come from one sort per row, prefix sums of p, q and q log(q / p) in the order
of q / p, and a bisection of hi on [D]-sized tensors; for each hi, lo is solved exactly (the mass
is piecewise linear in lo), so no iteration passes over the vocabulary. Greedy: p is one-hot,
so any other token costs infinite KL: the rule is ``exact``. D = 0 is ``rejection``. Chains only. Not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mars_bench.verification.base import VerifyInput, check_range, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule, toward
from mars_bench.verification.kernels import Prepared
from mars_bench.verification.strict import GreedyRule

BISECTIONS = 26  # halvings of log hi's interval: 2^-26 of its width


@dataclass(frozen=True)
class MentoredParams:
    """Settings of ``mentored``: kl_budget, D in nats per position (0 = the strict rule)."""

    kl_budget: float = 0.05

    def __post_init__(self) -> None:
        budget = check_range("kl_budget", self.kl_budget, 0.0, math.inf, "a finite number >= 0 (nats)")
        object.__setattr__(self, "kl_budget", budget)


def xlogx(value: torch.Tensor) -> torch.Tensor:
    return torch.where(value > 0, value * torch.log(value.clamp(min=1e-300)), torch.zeros_like(value))


class ClippedTarget:
    """pi = p * clip(q / p, lo, hi) for rows of p and q ([R, V]), evaluated from sorted prefix sums."""

    def __init__(self, p: torch.Tensor, q: torch.Tensor) -> None:
        p, q = p.double(), q.double()
        ratio = torch.where(p > 0, q / p.clamp(min=1e-300), torch.where(q > 0, math.inf, 0.0))
        self.ratio, self.p = ratio, p
        order = ratio.argsort(dim=-1)
        self.sorted_ratio = ratio.gather(-1, order).contiguous()
        p_sorted, q_sorted = p.gather(-1, order), q.gather(-1, order)
        kl_terms = torch.where(p_sorted > 0, xlogx(q_sorted) - q_sorted * torch.log(p_sorted.clamp(min=1e-300)), 0.0)
        zero = torch.zeros(p.shape[0], 1, dtype=p.dtype, device=p.device)
        self.p_below = torch.cat([zero, p_sorted.cumsum(-1)], dim=-1)  # [R, V+1]: p mass of the first i ratios
        # p mass from the i-th ratio on, summed from the top: a difference of two sums near 1
        # would lose a tiny mass above hi (a draft the target nearly rules out)
        self.p_above = torch.cat([p_sorted.flip(-1).cumsum(-1).flip(-1), zero], dim=-1)
        self.q_below = torch.cat([zero, q_sorted.cumsum(-1)], dim=-1)
        self.kl_below = torch.cat([zero, kl_terms.cumsum(-1)], dim=-1)
        # The mass at lo = the j-th ratio, less its hi-side terms: r_j * p_below[j] - q_below[j]
        # ([R, V], non-decreasing in j). Only lo in [0, 1] is ever solved for (the mass at lo = 1
        # is >= 1), so ratios above 1 are no breakpoints.
        usable = self.sorted_ratio <= 1.0
        at_ratio = self.sorted_ratio.where(usable, 0.0) * self.p_below[:, :-1] - self.q_below[:, :-1]
        self.breakpoint_mass = at_ratio.where(usable, math.inf).contiguous()

    def _parts(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(p mass below lo, the q and q log(q / p) sums between, p mass above hi) per row."""
        low = torch.searchsorted(self.sorted_ratio, lo[:, None], right=False)  # ratios below lo
        high = torch.searchsorted(self.sorted_ratio, hi[:, None], right=True)  # ratios up to hi
        at = lambda table, index: table.gather(-1, index).squeeze(-1)  # noqa: E731
        between = lambda table: at(table, high) - at(table, low)  # noqa: E731
        return at(self.p_below, low), between(self.q_below), between(self.kl_below), at(self.p_above, high)

    def mass(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        below, q_between, _, above = self._parts(lo, hi)
        return lo * below + q_between + hi * above

    def kl(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        below, _, kl_between, above = self._parts(lo, hi)
        return xlogx(lo) * below + kl_between + xlogx(hi) * above

    def lower_for(self, hi: torch.Tensor) -> torch.Tensor:
        """The lo in [0, 1] that makes pi sum to 1 for each row's hi >= 1 ([R] -> [R]), exactly.

        For lo between the (k-1)-th and k-th ratios the mass is lo * p_below[k] + C - q_below[k],
        with C = q_below[high] + hi * p_above[high] the terms at and above hi: linear and
        non-decreasing in lo, so the root's segment k is found by one search of the breakpoint
        masses and lo solved on it. Where the mass at lo = 0 already reaches 1 (no p mass below
        the root), lo is 0."""
        high = torch.searchsorted(self.sorted_ratio, hi[:, None], right=True)
        fixed = self.q_below.gather(-1, high).squeeze(-1) + hi * self.p_above.gather(-1, high).squeeze(-1)
        segment = torch.searchsorted(self.breakpoint_mass, (1.0 - fixed)[:, None], right=False)
        slope = self.p_below.gather(-1, segment).squeeze(-1)
        lo = (1.0 - fixed + self.q_below.gather(-1, segment).squeeze(-1)) / slope.clamp(min=1e-300)
        return torch.where(slope > 0, lo, torch.zeros_like(lo)).clamp(0.0, 1.0)

    def within(self, budget: float) -> torch.Tensor:
        """pi [R, V] with KL(pi || p) = budget, or the nearest to q when KL(q || p) <= budget.
        hi is bisected on a log scale: it runs from 1 to the largest finite q / p."""
        finite = torch.where(torch.isfinite(self.sorted_ratio), self.sorted_ratio, 0.0)
        low, high = torch.zeros_like(finite[:, 0]), torch.log(finite.max(dim=-1).values.clamp(min=1.0))
        for _ in range(BISECTIONS):
            middle = 0.5 * (low + high)
            hi = middle.exp()
            over = self.kl(self.lower_for(hi), hi) > budget
            low, high = torch.where(over, low, middle), torch.where(over, middle, high)
        hi = low.exp()  # the largest hi found within the budget
        target = self.p * self.ratio.clamp(min=0.0).clamp(self.lower_for(hi)[:, None], hi[:, None])
        target = torch.where(self.p > 0, target, torch.zeros_like(target))
        return target / target.sum(dim=-1, keepdim=True)


@register_verifier("mentored", params=MentoredParams)
class MentoredVerifier(ChainRule):
    __doc__ = __doc__
    params: MentoredParams

    def row_rule(self, rows: ChainRows) -> RowRule:
        if self.params.kl_budget == 0:
            return toward(rows.p, rows.q)
        target = ClippedTarget(rows.p, rows.q).within(self.params.kl_budget).to(rows.p.dtype)
        return toward(target, rows.q)

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        self.greedy_rows(step, prep)
        return super().greedy_rule(step, prep)
