"""``fly``: training-free loosely speculative decoding (Li et al., ICLR 2026, arXiv 2511.22972).

The native rule judges each draft x_i (greedy: x_i = argmax p_i; sampling: ``native``). A native
rejection at position i is overridden to an acceptance when

1. the target's entropy at i is >= ``entropy`` (the entropy-level gate; ``entropy_form`` says which
   entropy), and
2. the native rule accepts the drafts of the deferred window after i (``window`` positions,
   ``window_from`` says which), the window fits in the draft, and x_i is a token the target's
   processing allows (p > 0: not filtered by top-k / top-p; greedy: a finite logit).

The window's verdicts are the drafted continuation's own: the same coins that judge those positions.
The walk keeps the longest prefix of kept drafts and emits the native correction where it stops, or
a bonus from p (the argmax when greedy) after a fully kept chain.

``entropy_form`` (the gate's entropy):
- ``top3_raw`` (default; the official code, AMD-AGI/FLy ``calculate_topk_entropy``): -sum p log p in
  nats over the 3 largest entries of softmax(raw logits), unscaled by the temperature, unfiltered;
- ``top3_processed`` (vLLM ``compute_fly_entropy``): the same over the processed p (temperature,
  top-k, top-p); greedy: softmax of the raw logits, as vLLM's all-greedy batches;
- ``normalised`` (SecureSD ``securesd/verifier/fly.py``): the entropy of softmax(raw logits / T)
  (T = 1 when greedy; unfiltered) divided by log V, in [0, 1] (0 when V = 1).

``window_from`` (which native verdicts the deferred window reads, D drafts, positions 0..D-1):
- ``mismatch`` (default; official): the W positions i..i+W-1, so the W - 1 drafts after i; the official
  code also keeps its last W positions native, so i relaxes only where i + W < D;
- ``next`` (vLLM): the W drafts i+1..i+W, all drafted (i + W < D);
- ``next_or_bonus`` (SecureSD): the W positions i+1..i+W where position D, the bonus, counts as a
  native accept (i + W <= D: the drafts i+1..min(i+W, D-1)).

``native`` (the native test at T > 0; at T = 0 every form is argmax matching):
- ``pq`` (default; vLLM): accept with min(1, p / q), else a sample from norm(max(p - q, 0)), the strict
  rule: with a gate that never opens (``entropy`` above any entropy) fly is ``rejection`` exactly, random
  draws included, and FLy's override is the rule's only relaxation;
- ``two_samples`` (official): two samples from p per position, accept x if it is either, else emit the
  first (a sample from p without x); lossy on its own, and it ignores q;
- ``argmax`` (SecureSD): accept only x = argmax p, else a sample from p.

Chains only: vLLM and SecureSD judge chains; the official code's tree mode keeps the longest path,
with one sample per node, which no other tree rule here walks. Not lossless.

Emission (``fidelity=true``): greedy, a point mass, exact. Sampling: the window reads the other rows'
drafts, so P_V at row j is conditional on the realised drafts: the law of the token emitted at j
given that the walk reaches j, with x_j ~ q_j and every other draft as drafted (``emission``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from mars_bench.verification.base import (
    COUNT,
    VALUE,
    Reason,
    Statistic,
    Verdict,
    VerifyInput,
    check_choice,
    check_range,
    register_verifier,
)
from mars_bench.verification.emission import TINY, Emission, mix, normalised, proposal_rows
from mars_bench.verification.kernels import Prepared, RowDraws, TreeLayout, finish, gather_at, on_rows, strict_rejection
from mars_bench.verification.sampling import RandomStreams, SamplingParams, sample_rows, scaled
from mars_bench.verification.strict import GreedyRule, TreeVerifier

ENTROPY_FORMS = ("top3_raw", "top3_processed", "normalised")
WINDOWS_FROM = ("mismatch", "next", "next_or_bonus")
NATIVE_TESTS = ("pq", "two_samples", "argmax")
TOP = 3  # the entropy's top-k in the official code and vLLM


@dataclass(frozen=True)
class FlyParams:
    """Settings of ``fly``: the gate's ``entropy`` threshold (>= 0; nats, or a share of log V with
    ``entropy_form=normalised``), the deferred ``window`` W (>= 1), ``entropy_form``, ``window_from``
    and the ``native`` test at T > 0 (see the module docstring)."""

    entropy: float = 0.3
    window: int = 6
    entropy_form: str = "top3_raw"
    window_from: str = "mismatch"
    native: str = "pq"

    def __post_init__(self) -> None:
        allowed = "a finite number >= 0 (nats; a share of log V with entropy_form=normalised)"
        object.__setattr__(self, "entropy", check_range("entropy", self.entropy, 0.0, math.inf, allowed))
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window={self.window!r} is invalid: allowed is an integer >= 1")
        check_choice("entropy_form", self.entropy_form, ENTROPY_FORMS)
        check_choice("window_from", self.window_from, WINDOWS_FROM)
        check_choice("native", self.native, NATIVE_TESTS)


def top_entropy(logits: torch.Tensor, top: int = TOP) -> torch.Tensor:
    """FloatTensor[R]: -sum p log p over the ``top`` largest entries of softmax(logits [R, V]), in nats."""
    log_p = logits.topk(min(top, logits.shape[-1]), dim=-1).values - logits.logsumexp(dim=-1, keepdim=True)
    p = log_p.exp()
    return -torch.where(p > 0, p * log_p, 0.0).sum(dim=-1)


def fly_entropy(form: str, raw: torch.Tensor, processed: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """FloatTensor[R]: the entropy FLy's gate compares, per row of the raw target logits [R, V] and the
    verifier's processing of them [R, V] (``entropy_form``)."""
    greedy = sampling.greedy
    if form == "top3_raw":
        return top_entropy(raw.float())
    if form == "top3_processed":
        return top_entropy(processed if greedy else scaled(processed, sampling.temperature))
    log_p = torch.log_softmax(scaled(raw.float(), 1.0 if greedy else sampling.temperature), dim=-1)
    p = log_p.exp()
    entropy = -torch.where(p > 0, p * log_p, 0.0).sum(dim=-1)
    vocab = raw.shape[-1]
    return entropy / math.log(vocab) if vocab > 1 else torch.zeros_like(entropy)


def drafts_after(layout: TreeLayout, index: torch.Tensor) -> torch.Tensor:
    """LongTensor[N]: how many drafts follow each node of a chain forest in its request (no host read)."""
    starts = layout.root_row_tensor - torch.arange(len(layout.drafts_per_row), device=index.device)
    ends = torch.cat([starts[1:], starts.new_full((1,), index.shape[0])])
    return ends[layout.node_request] - index - 1


def reach_weights(
    native: torch.Tensor, relaxable: torch.Tensor, length: torch.Tensor, layout: TreeLayout, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per node of a chain forest ([N] each, float64): (P(the walk reaches the node with no window
    pending), E = P(it reaches it inside an earlier relaxation's window, and that window's drafts after
    the node are accepted), P(the node's own window passes)).

    native: the native rule's acceptance probability of each realised draft; relaxable: the probability
    that a native rejection there is overridden before the window is read (gate, fit, p > 0); length:
    the drafts each node's window reads. The native verdicts are independent coins, so a forward pass
    over the positions with the number of window drafts still owed as its state is exact.
    """
    counts, count = layout.drafts_per_row, native.shape[0]
    width, device = max(counts, default=0), native.device
    if count == 0:
        empty = torch.zeros(0, dtype=torch.float64, device=device)
        return empty, empty, empty
    slots = [[start + t if t < size else -1 for t in range(width + window)] for start, size in zip(layout.node_starts, counts)]
    index = torch.tensor(slots, dtype=torch.long, device=device)  # [B, width + window]: node per position
    real, at = index >= 0, index.clamp(min=0)
    accept = torch.where(real, native.double()[at], 1.0)
    relax = torch.where(real, relaxable.double()[at], 0.0)
    owed = torch.where(real, length[at], 0)
    ahead = [torch.ones_like(accept[:, :width])]  # ahead[l]: the product of the native accepts of the l drafts after t
    for step in range(1, window + 1):
        ahead.append(ahead[-1] * accept[:, step : step + width])
    ahead = torch.stack(ahead, dim=-1)  # [B, width, window + 1]
    state = torch.zeros(len(counts), window + 1, dtype=torch.float64, device=device)  # P(reach t, owing m)
    state[:, 0] = 1.0
    pending = []
    for t in range(width):
        pending.append(state)
        kept = accept[:, t : t + 1]
        state = torch.cat([state[:, 1:] * kept, torch.zeros_like(kept)], dim=1)
        state[:, 0] += pending[-1][:, 0] * kept[:, 0]
        deferred = pending[-1][:, 0] * (1.0 - kept[:, 0]) * relax[:, t]
        state = state.scatter_add(1, owed[:, t : t + 1], deferred[:, None])
    pending = torch.stack(pending, dim=1)  # [B, width, window + 1]
    owing = (pending[..., 1:] * ahead[..., :-1]).sum(dim=-1)  # owing m: the node and the m - 1 after it
    passes = ahead.gather(-1, owed[:, :width, None]).squeeze(-1)
    nodes = real[:, :width]
    return pending[..., 0][nodes], owing[nodes], passes[nodes]


@register_verifier("fly", params=FlyParams)
class FlyVerifier(TreeVerifier):
    __doc__ = __doc__
    lossless = False
    chains_only: ClassVar[bool] = True
    emission_given_drafts: ClassVar[bool] = True  # P_V at a row is conditional on the other rows' drafts
    statistics: ClassVar[tuple[Statistic, ...]] = (
        Statistic("entropy", VALUE, "the target's entropy the gate compares (entropy_form) at the row judging the draft"),
        Statistic("gate", COUNT, "the entropy gate opened: that entropy reached the threshold entropy"),
    )
    params: FlyParams

    def check_chain(self, prep: Prepared) -> None:
        if not prep.layout.chain:
            raise ValueError(f"verifier {self.name} judges chains only: got a tree of drafts (use a chain drafter)")

    def entropy(self, step: VerifyInput, prep: Prepared) -> torch.Tensor:
        """FloatTensor[N]: the entropy the gate compares, at the row judging each draft (``entropy_form``)."""
        layout = prep.layout
        return fly_entropy(
            self.params.entropy_form, layout.drafted_rows(step.target_logits), layout.drafted_rows(prep.processed), step.sampling
        )

    def gate(self, step: VerifyInput, prep: Prepared) -> torch.Tensor:
        """BoolTensor[N]: whether the entropy at the row judging each draft reaches ``entropy``."""
        return self.entropy(step, prep) >= self.params.entropy

    def judged(self, step: VerifyInput, prep: Prepared) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The gate per draft ([N]) and the declared statistics per row (``kernels.finish``)."""
        entropy = self.entropy(step, prep)
        gate = entropy >= self.params.entropy
        return gate, {"entropy": on_rows(entropy, prep.layout), "gate": on_rows(gate, prep.layout)}

    def window_of(self, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fits: BoolTensor[N], length: LongTensor[N], the native accepts the window reads after the
        node), from the drafts after each node ([N])."""
        width, convention = self.params.window, self.params.window_from
        if convention == "next_or_bonus":
            return after >= width - 1, after.clamp(max=width)
        return after >= width, torch.full_like(after, width - 1 if convention == "mismatch" else width)

    def relaxed(self, prep: Prepared, native: torch.Tensor, allowed: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """BoolTensor[N]: the native rejections FLy overrides, given the native verdicts ([N]), which
        drafts the target's processing allows ([N]) and where the gate opens ([N])."""
        count = native.shape[0]
        if count == 0:
            return native
        index = torch.arange(count, device=native.device)
        after = drafts_after(prep.layout, index)
        fits, length = self.window_of(after)
        # The first native rejection at or after each node, or its request's end: a reversed running minimum.
        stop = torch.where(native, index + after + 1, index)
        first_reject = stop.flip(0).cummin(0).values.flip(0)
        following = torch.cat([first_reject[1:], first_reject.new_full((1,), count)])
        return ~native & allowed & fits & (following >= index + 1 + length) & gate

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        self.check_chain(prep)
        drafts = step.draft_tokens
        native = drafts == prep.nodes.t1
        allowed = gather_at(prep.layout.drafted_rows(prep.processed), drafts) > -math.inf
        gate, statistics = self.judged(step, prep)
        relaxed = self.relaxed(prep, native, allowed, gate)
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        reasons = torch.where(native, int(Reason.EXACT), torch.where(relaxed, int(Reason.RELAXED), rejected))
        return GreedyRule(native | relaxed, reasons, statistics=statistics)

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        self.check_chain(prep)
        drafts, probs, layout = step.draft_tokens, prep.probs, prep.layout
        if self.params.native == "pq":
            strict = strict_rejection(probs, drafts, step.draft_dists, layout, streams)
            native, candidates, reason = strict.accepted, strict.candidates, Reason.SAMPLED
        elif self.params.native == "two_samples":
            uniform = streams.uniforms(layout.rows_per_request, drafts.device, torch.float64, (2,))
            samples = sample_rows(probs, None, uniform=uniform)  # [N+B, 2]: two target samples per row
            pair = prep.parent_rows(samples)
            native, candidates, reason = (drafts == pair[:, 0]) | (drafts == pair[:, 1]), samples[:, 0], Reason.EXACT
        else:
            native, candidates, reason = drafts == prep.nodes.t1, RowDraws(probs, streams), Reason.EXACT
        gate, statistics = self.judged(step, prep)
        relaxed = self.relaxed(prep, native, gather_at(layout.drafted_rows(probs), drafts) > 0, gate)
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        reasons = torch.where(native, int(reason), torch.where(relaxed, int(Reason.RELAXED), rejected))
        return finish(native | relaxed, reasons, candidates, prep, statistics=statistics)

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        """P_V at each drafted row j, conditional on the drafts: the law of the token emitted at j given
        that the walk reaches j, with x_j ~ q_j and every other draft as drafted.

        Reaching j either leaves no window pending (then j is judged by the native test with its own
        override, whose window passes with the product of the native accepts of its realised drafts) or
        falls inside an earlier override's window (then x_j was accepted natively: P_V = q s / alpha_s
        there). ``reach_weights`` gives the two branches' weights; where no override can reach j,
        P_V is the native rule's with the override, as ``rejection``'s is with none.
        """
        self.check_chain(prep)
        layout, drafts = prep.layout, step.draft_tokens
        p = layout.drafted_rows(prep.probs)
        q = proposal_rows(drafts, step.draft_dists, p.shape[-1])
        if self.params.native == "pq":
            keep = (p / q.clamp(min=TINY)).clamp(max=1.0)
        elif self.params.native == "two_samples":
            keep = 1.0 - (1.0 - p) ** 2
        else:
            keep = torch.zeros_like(p).scatter_(-1, layout.drafted_rows(prep.rows.t1)[:, None], 1.0)
        native = gather_at(keep, drafts)
        index = torch.arange(drafts.shape[0], device=drafts.device)
        fits, length = self.window_of(drafts_after(layout, index))
        open_ = self.gate(step, prep) & fits
        relaxable = open_ & (gather_at(p, drafts) > 0)
        clear, owing, passes = reach_weights(native, relaxable, length, layout, self.params.window)
        override = (open_.double() * passes).float()[:, None] * (p > 0)  # [N, V]: P(override | native reject)
        accept = keep + (1.0 - keep) * override
        if self.params.native == "two_samples":
            # A rejected x emits the first sample given that neither is x: p without x, renormalised.
            lost = q * (1.0 - p) * (1.0 - override)  # q(x) (1 - a(x)) / (1 - p(x))
            kept = q * accept
            judged = Emission(kept + p * (lost.sum(dim=-1, keepdim=True) - lost), kept.sum(dim=-1), layout.judging_rows)
        else:
            correction = normalised((p - q).clamp(min=0.0), p) if self.params.native == "pq" else p
            judged = mix(q, accept, correction, layout.judging_rows)
        # In float64 and as shares in [0, 1]: a natively kept mass near float32's smallest normal must
        # not meet a division guard (the walk can reach j with probability ~1e-38 and no other way).
        native_kept = q.double() * keep.double()
        native_alpha = native_kept.sum(dim=-1)
        inside = owing * native_alpha  # P(reach j inside a window, and x_j ~ q accepted natively there)
        total = clear + inside
        conditioned = (owing > 0) & (total > 0)
        safe_total = torch.where(conditioned, total, 1.0)
        share = torch.where(conditioned, inside / safe_total, 0.0)  # [N]: the window branch's weight
        stay = torch.where(conditioned, clear / safe_total, 1.0)
        kept_law = native_kept / torch.where(native_alpha > 0, native_alpha, 1.0)[:, None]  # zero rows stay zero
        dist = stay[:, None] * judged.dist.double() + share[:, None] * kept_law
        alpha = stay * judged.accept.double() + share  # inside a window x_j was accepted natively: alpha 1 there
        return Emission(dist.float(), alpha.float(), judged.rows)
