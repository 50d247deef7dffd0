"""``threshold``: SGLang's acceptance thresholds (``speculative_accept_threshold_single`` t_s and
``speculative_accept_threshold_acc`` t_a; the kernel ``TreeSpeculativeSamplingTargetOnly`` in
sgl-project/sglang ``sgl-kernel/csrc/speculative/speculative_sampling.cuh``, which
``python/sglang/srt/speculative/eagle_info.py`` calls with the draft probabilities zeroed).

The drafter's q is never read. Chain: keep a draft x when p(x) >= t_s or u < p(x) / t_a; after a
reject emit a sample from p with x removed and renormalised. Tree: the children of one row share
one coin u (here the uniform drawn for the row's first child); with S_k the p mass of the first k
children in draft order, the first child k with u < S_k / t_a or p(x_k) >= t_s is kept; after every
child is rejected a sample from p without them is emitted. A fully kept path ends with a sample from p.

P_V in closed form: a chain's row emits x with a = 1 if p(x) >= t_s else min(1, p(x) / t_a), and y != x
with (1 - a) p(y) / (1 - p(x)). At t_s = t_a = 1 a kept x has probability p(x) and P_V = p for any
draft and any q: lossless, the default. There a chain's verdicts equal ``rejection``'s with
deterministic drafts (its test is u < p(x) then, with the same uniform and the same residual); with
the drafter's distributions ``rejection`` reads q and this rule does not, and on a tree the shared
coin keeps a child with the same probability as ``rejection``'s per-child coins, not on the same draws.

Greedy: SGLang sends greedy requests to its argmax verification, and with p one-hot the thresholds
keep exactly the argmax (p(x) >= t_s only there, u < 0 never): ``exact`` whatever the settings.
SGLang compares u <= S / t_a; here u < S / t_a, as every rule here tests its uniform (the two differ
on a set of probability 0). Not lossless below 1 / 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.verification.base import Reason, Verdict, VerifyInput, check_unit_interval, register_verifier
from mars_bench.verification.emission import TINY, Emission, normalised, sequential
from mars_bench.verification.kernels import Prepared, RowDraws, TreeLayout, at_nodes, finish, residual_rows
from mars_bench.verification.sampling import RandomStreams
from mars_bench.verification.strict import TreeVerifier


@dataclass(frozen=True)
class ThresholdParams:
    """Settings of ``threshold``: threshold_single (t_s) and threshold_acc (t_a), each in (0, 1]; 1 and 1
    (the default) is lossless."""

    threshold_single: float = 1.0
    threshold_acc: float = 1.0

    def __post_init__(self) -> None:
        for option in ("threshold_single", "threshold_acc"):
            object.__setattr__(self, option, check_unit_interval(option, getattr(self, option)))


def sibling_running_sum(values: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """FloatTensor[N]: each node's ``values`` ([N]) plus those of its earlier siblings (one step per sibling rank)."""
    total = values.clone()
    for nodes, before in layout.sibling_waves:
        total[nodes] = total[before] + values[nodes]
    return total


def shared_coins(uniforms: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """FloatTensor[N]: the uniform ([N], one per node) of each node's first sibling, the coin its row shares."""
    if not layout.sibling_waves:
        return uniforms
    first = torch.arange(uniforms.shape[0], device=uniforms.device)
    for nodes, before in layout.sibling_waves:
        first[nodes] = first[before]
    return uniforms[first]


@register_verifier("threshold", params=ThresholdParams)
class ThresholdVerifier(TreeVerifier):
    __doc__ = __doc__
    lossless = False
    params: ThresholdParams

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        drafts, layout = step.draft_tokens, prep.layout
        p_node = at_nodes(prep.probs, drafts, layout)
        mass = sibling_running_sum(p_node, layout)
        coin = shared_coins(streams.node_uniforms(drafts.device), layout)
        accepted = (coin < mass / self.params.threshold_acc) | (p_node >= self.params.threshold_single)
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        reasons = torch.where(accepted, torch.where(coin < mass, int(Reason.SAMPLED), int(Reason.RELAXED)), rejected)
        weights = residual_rows(prep.probs, drafts, None, layout)  # p without the row's children: q is never read
        return finish(accepted, reasons, RowDraws(weights, streams), prep)

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        probs, layout, drafts = prep.probs, prep.layout, step.draft_tokens
        single, acc = self.params.threshold_single, self.params.threshold_acc
        if step.draft_dists is None:
            p_node = at_nodes(probs, drafts, layout)
            mass = sibling_running_sum(p_node, layout)
            before = ((mass - p_node) / acc).clamp(max=1.0)  # P(u < S_{k-1} / t_a): an earlier sibling took the coin
            upto = (mass / acc).clamp(max=1.0)
            left = 1.0 - before
            # Kept when its turn comes (every earlier sibling rejected): u is uniform on [before, 1) then.
            turn = torch.where(left > 0, (upto - before) / left.clamp(min=TINY), torch.ones_like(left))
            accept = torch.where(p_node >= single, torch.ones_like(turn), turn)
            return sequential(accept, drafts, normalised(residual_rows(probs, drafts, None, layout), probs), layout)
        # A chain with the drafter's distributions: x ~ q, and the correction p without x depends on x.
        p, q = layout.drafted_rows(probs), step.draft_dists.float()
        accept = torch.where(p >= single, torch.ones_like(p), (p / acc).clamp(max=1.0))
        kept = q * accept
        refused = torch.where(accept < 1, q * (1.0 - accept) / (1.0 - p).clamp(min=TINY), torch.zeros_like(q))
        return Emission(kept + p * (refused.sum(dim=-1, keepdim=True) - refused), kept.sum(dim=-1), layout.judging_rows)
