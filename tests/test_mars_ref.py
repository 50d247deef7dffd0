"""``mars_ref`` follows the official code's sampling branch (``evaluate_posterior``; see mars_ref.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest, chisquare

from mars_bench.verification import Reason, VerifyInput, get_verifier
from mars_bench.verification.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

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


@pytest.mark.slow
def test_triggered_reject_samples_the_next_token_from_the_unmodified_p():
    rows = [[3.0, 2.9, 2.5, 1.0], [0.0, 0.0, 0.0, 0.0]]  # r = 0.967 > 0.9; the draft (3) is outside the top 2
    verdicts = run(chain(rows, [3], [0.9]))
    assert all(v.accepted_len == 0 for v in verdicts)
    counts = torch.bincount(torch.tensor([v.next_token for v in verdicts]), minlength=4)
    expected = torch.softmax(torch.tensor(rows[0], dtype=torch.float64), -1) * DRAWS
    assert counts[3] > 0  # the rejected draft itself can be emitted: p was not modified
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.slow
def test_strict_branch_accepts_with_min_one_p_over_q():
    rows = [[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]  # r = 0.5: not triggered
    p = torch.softmax(torch.tensor(rows[0]), -1)
    q = 0.6
    verdicts = run(chain(rows, [1], [q]))
    accepted = sum(v.accepted_len for v in verdicts)
    assert binomtest(accepted, DRAWS, float(p[1] / q)).pvalue > 1e-3


@pytest.mark.slow
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
    assert all(v.decisions.statistics["trigger"].tolist() == [True] for v in verdicts)
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
    assert run(chain(rows, [2], [0.5]), draws=1)[0].decisions.statistics["trigger"].tolist() == [True]
    greedy = VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.tensor(rows))
    decisions = get_verifier("mars_ref").verify(greedy).decisions
    assert decisions.statistics["trigger"].tolist() == [False]


def official_acceptance(processed_row: torch.Tensor, draft: int, q: float, theta: float) -> float:
    """The official code's probability of keeping one draft at one row (reference/mars.md 1.3b),
    written out here: the top-2 set is ``torch.topk`` of the processed 1-D row, the trigger the
    raw ratio of its two values in Python floats; a triggered row keeps a draft in that set,
    any other row keeps it with probability min(1, p / max(q, 1e-10))."""
    values, indices = torch.topk(processed_row, k=min(2, processed_row.shape[0]))
    triggered = values.shape[0] >= 2 and values[1].item() / (values[0].item() + 1e-10) > theta
    if triggered:
        return float(draft in indices.tolist())
    p = torch.softmax(processed_row.double(), dim=0)[draft].item()
    return min(1.0, p / max(q, 1e-10))


def check_against_the_official_rule(logits: list[float], sampling: SamplingParams, draft: int) -> float:
    """Verdicts and the emission of one draft (q = 1) agree with ``official_acceptance``; returns it."""
    verifier = get_verifier("mars_ref", theta=0.9)
    rows = torch.tensor([logits, [0.0] * len(logits)])
    step = VerifyInput(torch.tensor([draft]), torch.tensor([-1]), rows, sampling, draft_probs=torch.tensor([1.0]))
    expected = official_acceptance(verifier.process(rows, sampling)[0], draft, 1.0, 0.9)
    assert expected in (0.0, 1.0)  # triggered: deterministic
    verdicts = [verifier.verify(step, generator=torch.Generator().manual_seed(seed)) for seed in range(20)]
    assert all(v.accepted_len == expected and v.decisions.statistics["trigger"].tolist() == [True] for v in verdicts)
    assert float(verifier.emission(step).accept[0]) == expected
    return expected


def test_tied_top_logits_give_the_top_two_set_of_torch_topk_as_in_the_official_code():
    logits = [4.0, 4.0, 4.0, 0.0]  # T = 1, theta 0.9, q = 1: r = 1 triggers
    official = torch.topk(torch.tensor(logits), 2).indices.tolist()
    assert set(official) != {0, 1}  # the first-index rule's set: this case tells the two apart
    kept = {draft for draft in range(4) if check_against_the_official_rule(logits, SAMPLE, draft)}
    assert kept == set(official)
    # Reasons: topk's first index counts as EXACT, the other top-2 token as RELAXED.
    for draft, reason in zip(official, (Reason.EXACT, Reason.RELAXED)):
        assert run(chain([logits, [0.0] * 4], [draft], [1.0]), draws=1)[0].decisions.reasons.tolist() == [reason]
    # A chain with the drafter's full q: P_V keeps q on the official set and draws p for the rest.
    q = torch.tensor([0.4, 0.1, 0.2, 0.3])
    step = VerifyInput(torch.tensor([0]), torch.tensor([-1]), torch.tensor([logits, [0.0] * 4]), SAMPLE,
                       draft_probs=q[[0]], draft_dists=q[None])  # fmt: skip
    emission = get_verifier("mars_ref", theta=0.9).emission(step)
    in_set = torch.zeros(4).index_fill_(0, torch.tensor(official), 1.0)
    p = torch.softmax(torch.tensor(logits), dim=0)
    assert torch.allclose(emission.accept, (q * in_set).sum()[None])
    assert torch.allclose(emission.dist[0], q * in_set + p * (q * (1 - in_set)).sum(), atol=1e-6)


def test_a_runner_up_filtered_to_minus_inf_is_taken_as_torch_topk_takes_it():
    logits = [-14.9539, -13.2159, -7.6233, -14.3229, -9.6276, -5.1182, -14.1687, -12.4925]
    sampling = SamplingParams(temperature=1.0, top_p=0.5, top_k=3)
    processed = get_verifier("mars_ref").process(torch.tensor([logits]), sampling)[0]
    assert torch.isfinite(processed).nonzero().flatten().tolist() == [5]  # only token 5 survives
    official = torch.topk(processed, 2).indices.tolist()  # z1 < 0, z2 = -inf: z2 / z1 = +inf triggers
    assert official[0] == 5 and official[1] != 0  # the first-index rule's runner-up would be token 0
    kept = {draft for draft in range(8) if check_against_the_official_rule(logits, sampling, draft)}
    assert kept == set(official)


TIED_LOGIT = st.one_of(st.integers(-3, 3).map(float), st.just(-math.inf))


@st.composite
def tied_steps(draw) -> VerifyInput:
    """A chain over rows of few distinct logits (ties everywhere, -inf entries, each row with a
    finite one) under top-p and top-k filters: one drafted token per position."""
    vocab, drafted = draw(st.integers(2, 7)), draw(st.integers(0, 3))
    rows = [[draw(TIED_LOGIT) for _ in range(vocab)] for _ in range(drafted + 1)]
    for row in rows:
        row[draw(st.integers(0, vocab - 1))] = float(draw(st.integers(-3, 3)))
    sampling = SamplingParams(
        temperature=1.0, top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.2])), top_k=draw(st.sampled_from([0, 1, 2, 3]))
    )
    drafts = torch.tensor([draw(st.integers(0, vocab - 1)) for _ in range(drafted)], dtype=torch.long)
    return VerifyInput(drafts, torch.arange(-1, drafted - 1), torch.tensor(rows), sampling)


@settings(max_examples=300, deadline=None)
@given(step=tied_steps(), shift=st.sampled_from([0.0, -10.0]))
@pytest.mark.slow
def test_the_top_two_set_is_torch_topk_of_each_processed_row(step, shift):
    # shift -10 makes every finite logit negative, so every row triggers and the verdicts show the set.
    step = replace(step, target_logits=step.target_logits + shift)
    verifier = get_verifier("mars_ref", theta=0.9)
    _, prep = verifier.prepare(step)
    processed = verifier.process(step.target_logits, step.sampling)
    for row, logits in enumerate(processed):
        values, indices = torch.topk(logits, 2)
        assert [int(prep.rows.t1[row]), int(prep.rows.t2[row])] == indices.tolist()
        assert [float(prep.rows.z1[row]), float(prep.rows.z2[row])] == values.tolist()
    verdict = verifier.verify(step, generator=torch.Generator().manual_seed(0))
    emission = verifier.emission(step)
    for node, draft in enumerate(step.draft_tokens.tolist()):
        expected = official_acceptance(processed[node], draft, 1.0, 0.9)
        assert float(emission.accept[node]) == pytest.approx(expected, abs=1e-6)
        if expected in (0.0, 1.0) and node <= verdict.accepted_len:  # a deterministic verdict at a reached node
            assert (node < verdict.accepted_len) == bool(expected)
