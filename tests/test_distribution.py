"""Lossless sampling: speculative decoding with ``rejection`` (and ``exact``) emits sequences
distributed exactly as the target's, by a chi-square test on a toy Markov target."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from conftest import SHARES, on_every_core
from scipy.stats import chisquare

from mars_bench.verification import VerifyInput, get_verifier
from mars_bench.verification.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # every test draws 6,000 sequences, of tiny tensors

VOCAB, LENGTH, GAMMA, DRAWS = 3, 3, 2, 6000
MIN_EXPECTED = 5.0
SAMPLE = SamplingParams(temperature=1.0)


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """Logits of next token given the previous token: [VOCAB, VOCAB]."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * sharpness


TARGET, DRAFTER = markov(0, 1.5), markov(1, 1.0)
# A drafter over a reduced vocabulary (drafter.draft_vocab): token 2 is off its subset, so q(2) = 0.
REDUCED_DRAFTER = DRAFTER.clone().index_fill_(1, torch.tensor([2]), float("-inf"))


def speculative_sequence(
    verifier,
    generator: torch.Generator,
    deterministic_drafts: bool,
    target: torch.Tensor,
    drafter: torch.Tensor = DRAFTER,
    reported: torch.Tensor | None = None,
) -> tuple[int, ...]:
    """Decode LENGTH tokens after token 0 with drafts from ``drafter`` verified against ``target``
    (told the q of ``reported`` instead, where given: a broken drafter)."""
    sequence = [0]
    while len(sequence) - 1 < LENGTH:
        drafts, dists, last = [], [], sequence[-1]
        for _ in range(GAMMA):
            q = torch.softmax(drafter[last], -1)
            token = int(q.argmax()) if deterministic_drafts else int(torch.multinomial(q, 1, generator=generator))
            drafts.append(token)
            dists.append(q if reported is None else torch.softmax(reported[last], -1))
            last = token
        context = [sequence[-1], *drafts]
        step = VerifyInput(
            torch.tensor(drafts),
            torch.arange(-1, GAMMA - 1),
            target[torch.tensor(context)],
            SAMPLE,
            draft_dists=None if deterministic_drafts else torch.stack(dists),
        )
        verdict = verifier.verify(step, generator=generator)
        sequence += drafts[: verdict.accepted_len] + [verdict.next_token]
    return tuple(sequence[1 : LENGTH + 1])


def tree_drafts(last: int) -> tuple[list[int], list[int]]:
    """A depth-2 tree: the drafter's top-2 tokens after ``last``, each with its own top-2 children."""
    tokens, parents = [], []
    for first in torch.topk(DRAFTER[last], 2).indices.tolist():
        tokens.append(first)
        parents.append(-1)
        parent = len(tokens) - 1
        for second in torch.topk(DRAFTER[first], 2).indices.tolist():
            tokens.append(second)
            parents.append(parent)
    return tokens, parents


def speculative_tree_sequence(verifier, generator: torch.Generator, target: torch.Tensor) -> tuple[int, ...]:
    """Decode LENGTH tokens after token 0, verifying a deterministic tree of drafts per step."""
    sequence = [0]
    while len(sequence) - 1 < LENGTH:
        drafts, parents = tree_drafts(sequence[-1])
        rows = torch.tensor([sequence[-1], *drafts])
        step = VerifyInput(torch.tensor(drafts), torch.tensor(parents), target[rows], SAMPLE)
        verdict = verifier.verify(step, generator=generator)
        sequence += [drafts[node] for node in verdict.accepted.tolist()] + [verdict.next_token]
    return tuple(sequence[1 : LENGTH + 1])


def target_joint(target: torch.Tensor) -> dict[tuple[int, ...], float]:
    probs = torch.softmax(target.double(), -1)
    joint = {}
    for sequence in itertools.product(range(VOCAB), repeat=LENGTH):
        mass, last = 1.0, 0
        for token in sequence:
            mass *= float(probs[last, token])
            last = token
        joint[sequence] = mass
    return joint


def chi_square_pvalue(
    name: str,
    deterministic_drafts: bool,
    target: torch.Tensor = TARGET,
    tree: bool = False,
    drafter: torch.Tensor = DRAFTER,
    reported: torch.Tensor | None = None,
    **params,
) -> float:
    verifier = get_verifier(name, **params)

    def draw(part: int) -> Counter:
        """The sequences of one of the draws' SHARES (conftest.on_every_core), from a generator of its own."""
        generator = torch.Generator().manual_seed(1234 + part)
        drawn: Counter = Counter()
        for _ in range(DRAWS // SHARES):
            if tree:
                drawn[speculative_tree_sequence(verifier, generator, target)] += 1
            else:
                drawn[speculative_sequence(verifier, generator, deterministic_drafts, target, drafter, reported)] += 1
        return drawn

    counts = sum(on_every_core(draw), Counter())
    joint = target_joint(target)
    total = sum(joint.values())
    expected = {sequence: mass / total * DRAWS for sequence, mass in joint.items()}
    # Chi-square needs about 5 expected draws per cell: one draw of a sequence expected 0.02
    # times would alone reject at p < 1e-6. Such sequences are tested as one pooled cell.
    common = [sequence for sequence, count in expected.items() if count >= MIN_EXPECTED]
    rare = [sequence for sequence in expected if sequence not in common]
    observed = [counts.get(sequence, 0) for sequence in common] + [sum(counts.get(sequence, 0) for sequence in rare)]
    predicted = [expected[sequence] for sequence in common] + [sum(expected[sequence] for sequence in rare)]
    return chisquare(observed, predicted).pvalue


@pytest.mark.parametrize("deterministic_drafts", [False, True], ids=["sampled-drafts", "greedy-drafts"])
@pytest.mark.parametrize("name", ["rejection", "exact"])
def test_lossless_verifiers_preserve_the_target_distribution(name, deterministic_drafts):
    assert chi_square_pvalue(name, deterministic_drafts) > 1e-3


@pytest.mark.parametrize("deterministic_drafts", [False, True], ids=["sampled-drafts", "greedy-drafts"])
@pytest.mark.parametrize("name", ["rejection", "exact"])
def test_lossless_verifiers_stay_lossless_when_q_lives_on_a_reduced_vocabulary(name, deterministic_drafts):
    # Sequences holding token 2 are never drafted whole; the correction must still give them mass p.
    assert chi_square_pvalue(name, deterministic_drafts, drafter=REDUCED_DRAFTER) > 1e-3


def test_the_reduced_vocabulary_test_detects_a_drafter_that_reports_the_full_vocabularys_q():
    # Negative control: drafting on the subset while telling the verifier the unreduced q biases the output.
    assert chi_square_pvalue("rejection", False, drafter=REDUCED_DRAFTER, reported=DRAFTER) < 1e-6


@pytest.mark.parametrize("name", ["rejection", "exact"])
def test_lossless_verifiers_preserve_the_target_distribution_over_trees(name):
    assert chi_square_pvalue(name, True, tree=True) > 1e-3


def test_mars_with_relaxation_off_preserves_the_target_distribution_over_trees():
    assert chi_square_pvalue("mars", True, tree=True, theta=None) > 1e-3


def test_the_tree_test_detects_a_rejection_rule_that_ignores_earlier_siblings():
    # Negative control: a second sibling tested on the unrenormalised p is accepted too rarely.
    from mars_bench.verification import kernels

    original = kernels.sibling_normalisers
    kernels.sibling_normalisers = lambda p_node, q_node, layout: torch.ones_like(p_node)
    try:
        assert chi_square_pvalue("rejection", True, tree=True) < 1e-6
    finally:
        kernels.sibling_normalisers = original


def test_mars_with_relaxation_off_preserves_the_target_distribution():
    assert chi_square_pvalue("mars", False, theta=None) > 1e-3


@pytest.mark.parametrize(("name", "params"), [("mars", {"theta": 0.3}), ("typical", {})])
def test_the_test_detects_a_lossy_rule(name, params):
    # Negative control: every row has a runner-up with ratio 0.5, so relaxation fires everywhere.
    target = torch.tensor([[2.0, 1.0, -1.0], [-1.0, 2.0, 1.0], [1.0, -1.0, 2.0]])
    assert chi_square_pvalue(name, False, target, **params) < 1e-6
