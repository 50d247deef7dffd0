"""``mars_ref`` follows the official code's sampling branch (reference/mars.md 1.3b)."""

from __future__ import annotations

import torch
from scipy.stats import binomtest, chisquare

from mars_bench.verification import Reason, VerifyInput, get_verifier
from mars_bench.verification.sampling import SamplingParams

SAMPLE = SamplingParams(temperature=1.0)
DRAWS = 4000


def chain(rows, drafts, probs=None) -> VerifyInput:
    return VerifyInput(
        torch.tensor(drafts),
        torch.arange(-1, len(drafts) - 1),
        torch.tensor(rows, dtype=torch.float32),
        SAMPLE,
        draft_probs=None if probs is None else torch.tensor(probs),
    )


def run(step: VerifyInput, draws: int = DRAWS, theta: float | None = 0.9):
    verifier = get_verifier("mars_ref", theta=theta)
    return [verifier.verify(step, generator=torch.Generator().manual_seed(seed)) for seed in range(draws)]


def test_triggered_position_accepts_either_top_two_token_deterministically():
    rows = [[10.0, 9.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    for draft in (0, 1):
        verdicts = run(chain(rows, [draft], [0.01]), draws=30)
        assert all(v.accepted_len == 1 for v in verdicts)
    assert run(chain(rows, [1], [0.01]), draws=1)[0].decisions.reasons.tolist() == [Reason.RELAXED]


def test_triggered_reject_samples_the_next_token_from_the_unmodified_p():
    rows = [[3.0, 2.9, 2.5, 1.0], [0.0, 0.0, 0.0, 0.0]]  # r = 0.967 > 0.9; the draft (3) is outside the top 2
    verdicts = run(chain(rows, [3], [0.9]))
    assert all(v.accepted_len == 0 for v in verdicts)
    counts = torch.bincount(torch.tensor([v.next_token for v in verdicts]), minlength=4)
    expected = torch.softmax(torch.tensor(rows[0], dtype=torch.float64), -1) * DRAWS
    assert counts[3] > 0  # the rejected draft itself can be emitted: p was not modified
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_strict_branch_accepts_with_min_one_p_over_q():
    rows = [[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]  # r = 0.5: not triggered
    p = torch.softmax(torch.tensor(rows[0]), -1)
    q = 0.6
    verdicts = run(chain(rows, [1], [q]))
    accepted = sum(v.accepted_len for v in verdicts)
    assert binomtest(accepted, DRAWS, float(p[1] / q)).pvalue > 1e-3


def test_strict_reject_samples_from_the_one_coordinate_residual():
    rows = [[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    p = torch.softmax(torch.tensor(rows[0]), -1)
    q = 0.6
    rejected = [v.next_token for v in run(chain(rows, [1], [q])) if v.accepted_len == 0]
    adjusted = p.clone()
    adjusted[1] = max(0.0, float(p[1]) - q)
    counts = torch.bincount(torch.tensor(rejected), minlength=4)
    assert counts[1] == 0
    keep = adjusted > 0
    expected = adjusted[keep].double() / adjusted[keep].double().sum() * len(rejected)
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3


def test_greedy_mode_is_plain_exact_matching():
    rows = [[10.0, 9.9, 0.0], [0.0, 0.0, 5.0]]
    step = VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.tensor(rows))
    verdict = get_verifier("mars_ref").verify(step)
    assert verdict.accepted_len == 0 and verdict.next_token == 0


def test_both_logits_negative_always_trigger_as_in_the_official_code():
    rows = [[-1.0, -3.0, -9.0], [0.0, 0.0, 0.0]]  # raw ratio 3.0 > 0.9
    verdicts = run(chain(rows, [1], [0.99]), draws=20)
    assert all(v.accepted_len == 1 for v in verdicts)
    mars = get_verifier("mars", theta=0.9)  # the guarded rule does not relax here
    step = chain(rows, [1], [0.99])
    step = VerifyInput(step.draft_tokens, step.parents, step.target_logits)  # greedy
    assert mars.verify(step).accepted_len == 0
