"""``mars_ref`` follows the official code's sampling branch (``evaluate_posterior``; see mars_ref.py)."""

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


def test_the_trigger_ratio_is_taken_in_float64_as_the_official_python_floats():
    theta, z1, z2 = 0.92, 3.8831419944763184, 3.572490692138672  # exact float32 values
    in_float64 = z2 / (z1 + 1e-10) > theta  # Python floats, as the official code divides them
    in_float32 = bool(torch.tensor(z2) / (torch.tensor(z1) + 1e-10) > theta)
    assert in_float64 and not in_float32  # the ratio rounds to float32(0.92) in float32
    step = chain([[z1, z2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [1], [1.0])  # strict test alone: p(1) = 0.41
    verdicts = run(step, draws=20, theta=theta)
    assert all(v.decisions.triggered.tolist() == [True] for v in verdicts)
    assert all(v.decisions.reasons.tolist() == [Reason.RELAXED] for v in verdicts)


def test_top_p_is_applied_before_top_k_as_in_the_official_code():
    # p = (0.4, 0.3, 0.2, 0.1), top-k 2 and top-p 0.5. Top-p first keeps {0, 1} (0.4 < 0.5) and top-k
    # keeps both; top-k first renormalises {0, 1} to (0.57, 0.43) and top-p then keeps {0} only.
    logits = (torch.tensor([0.4, 0.3, 0.2, 0.1]).log() + 10.0).tolist()
    sampling = SamplingParams(temperature=1.0, top_p=0.5, top_k=2)
    kept = {name: torch.isfinite(get_verifier(name).process(torch.tensor([logits]), sampling))[0].tolist()
            for name in ("mars_ref", "mars", "rejection")}  # fmt: skip
    assert kept["mars_ref"] == [True, True, False, False]
    assert kept["mars"] == kept["rejection"] == [True, False, False, False]
    # Token 1 survives for mars_ref, where r = z2 / z1 = 0.97 triggers: it is relaxed every time.
    step = VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.tensor([logits, [0.0] * 4]), sampling)
    verdicts = run(step, draws=20)
    assert all(v.accepted_len == 1 and v.decisions.reasons.tolist() == [Reason.RELAXED] for v in verdicts)
    mars = get_verifier("mars", theta=0.9)  # top-k first: z2 = -inf, no trigger, and p(1) = 0
    assert all(mars.verify(step, generator=torch.Generator().manual_seed(s)).accepted_len == 0 for s in range(20))
    # With no drafts the emitted token comes from the official processing: token 1 appears.
    empty = VerifyInput(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), torch.tensor([logits]), sampling)
    emitted = {v.next_token for v in run(empty, draws=200)}
    assert emitted == {0, 1}


def test_the_trigger_is_reported_and_fires_nowhere_in_greedy_mode():
    rows = [[-1.0, -3.0, -9.0], [0.0, 0.0, 0.0]]  # raw ratio 3.0 > 0.9: triggered when sampling
    assert run(chain(rows, [2], [0.5]), draws=1)[0].decisions.triggered.tolist() == [True]
    greedy = VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.tensor(rows))
    decisions = get_verifier("mars_ref").verify(greedy).decisions
    assert decisions.triggered.tolist() == [False] and decisions.triggered_count == 0
