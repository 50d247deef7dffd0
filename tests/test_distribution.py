"""Lossless sampling: speculative decoding with ``rejection`` (and ``exact``) emits sequences
distributed exactly as the target's, by a chi-square test on a toy Markov target."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from mars_bench.verification import VerifyInput, get_verifier
from mars_bench.verification.sampling import SamplingParams

VOCAB, LENGTH, GAMMA, DRAWS = 3, 3, 2, 6000
SAMPLE = SamplingParams(temperature=1.0)


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """Logits of next token given the previous token: [VOCAB, VOCAB]."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * sharpness


TARGET, DRAFTER = markov(0, 1.5), markov(1, 1.0)


def speculative_sequence(
    verifier, generator: torch.Generator, deterministic_drafts: bool, target: torch.Tensor
) -> tuple[int, ...]:
    """Decode LENGTH tokens after token 0 with drafts from DRAFTER verified against TARGET."""
    sequence = [0]
    while len(sequence) - 1 < LENGTH:
        drafts, dists, last = [], [], sequence[-1]
        for _ in range(GAMMA):
            q = torch.softmax(DRAFTER[last], -1)
            token = int(q.argmax()) if deterministic_drafts else int(torch.multinomial(q, 1, generator=generator))
            drafts.append(token)
            dists.append(q)
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


def chi_square_pvalue(name: str, deterministic_drafts: bool, target: torch.Tensor = TARGET, **params) -> float:
    verifier = get_verifier(name, **params)
    generator = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(DRAWS):
        sequence = speculative_sequence(verifier, generator, deterministic_drafts, target)
        counts[sequence] = counts.get(sequence, 0) + 1
    joint = target_joint(target)
    observed = [counts.get(sequence, 0) for sequence in joint]
    total = sum(joint.values())
    expected = [mass / total * DRAWS for mass in joint.values()]
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("deterministic_drafts", [False, True], ids=["sampled-drafts", "greedy-drafts"])
@pytest.mark.parametrize("name", ["rejection", "exact"])
def test_lossless_verifiers_preserve_the_target_distribution(name, deterministic_drafts):
    assert chi_square_pvalue(name, deterministic_drafts) > 1e-3


def test_mars_with_relaxation_off_preserves_the_target_distribution():
    assert chi_square_pvalue("mars", False, theta=None) > 1e-3


@pytest.mark.parametrize(("name", "params"), [("mars", {"theta": 0.3}), ("typical", {})])
def test_the_test_detects_a_lossy_rule(name, params):
    # Negative control: every row has a runner-up with ratio 0.5, so relaxation fires everywhere.
    target = torch.tensor([[2.0, 1.0, -1.0], [-1.0, 2.0, 1.0], [1.0, -1.0, 2.0]])
    assert chi_square_pvalue(name, False, target, **params) < 1e-6
