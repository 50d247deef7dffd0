"""Lossless sampling: speculative decoding with ``rejection`` (and ``exact``) emits sequences
distributed exactly as the target's, by a chi-square test on a toy Markov target."""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections import Counter

import pytest
import torch
from conftest import SHARES, on_every_core, pooled_chi_square

from mars_bench.verification import VerifyInput, batch_steps, get_verifier
from mars_bench.verification.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # every test draws 6,000 sequences, of tiny tensors

VOCAB, LENGTH, GAMMA, DRAWS = 3, 3, 2, 6000
SAMPLE = SamplingParams(temperature=1.0)


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """Logits of next token given the previous token: [VOCAB, VOCAB]."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * sharpness


TARGET, DRAFTER = markov(0, 1.5), markov(1, 1.0)
# A drafter over a reduced vocabulary (drafter.draft_vocab): token 2 is off its subset, so q(2) = 0.
REDUCED_DRAFTER = DRAFTER.clone().index_fill_(1, torch.tensor([2]), float("-inf"))


class ToyDecoder:
    """Speculative decoding of the toy Markov chain: drafts from ``drafter`` verified against ``target``
    (the verifier told the q of ``reported`` instead, where given: a broken drafter).

    The drafter's distributions and each step's ``VerifyInput`` are built once per context (the previous
    token and the drafts): there are VOCAB ** (GAMMA + 1) of them, and a draw then costs its share of the
    batched verifies."""

    def __init__(self, deterministic_drafts: bool, target: torch.Tensor, drafter: torch.Tensor, reported: torch.Tensor | None):
        self.deterministic_drafts, self.target = deterministic_drafts, target
        q = torch.softmax(drafter, -1)
        self.told = q if reported is None else torch.softmax(reported, -1)  # q per previous token [VOCAB, VOCAB]
        self.greedy = q.argmax(-1).tolist()
        self.cdf = q.double().cumsum(-1).tolist()
        self.steps: dict[tuple[int, ...], VerifyInput] = {}

    def draft(self, last: int, generator: torch.Generator) -> list[int]:
        """GAMMA drafts after ``last``: the drafter's argmax chain, or samples by inverse CDF (one uniform each)."""
        drafts = []
        uniforms = None if self.deterministic_drafts else torch.rand(GAMMA, generator=generator, dtype=torch.float64).tolist()
        for index in range(GAMMA):
            # u * total < total, so the draw never lands past the last token q gives mass (q(x) = 0 is never drawn)
            last = self.greedy[last] if uniforms is None else bisect_right(self.cdf[last], uniforms[index] * self.cdf[last][-1])
            drafts.append(last)
        return drafts

    def step(self, context: tuple[int, ...]) -> VerifyInput:
        """The verification of ``context`` (the last token, then the drafts)."""
        if context not in self.steps:
            drafts, rows = torch.tensor(context[1:]), torch.tensor(context)
            dists = None if self.deterministic_drafts else self.told[rows[:-1]]
            self.steps[context] = VerifyInput(drafts, torch.arange(-1, GAMMA - 1), self.target[rows], SAMPLE, draft_dists=dists)
        return self.steps[context]

    def sequences(self, verifier, generator: torch.Generator, count: int) -> list[tuple[int, ...]]:
        """Decode ``count`` sequences of LENGTH tokens after token 0 (``decode_together``)."""

        def step(sequence: list[int]) -> tuple[list[int], VerifyInput]:
            drafts = self.draft(sequence[-1], generator)
            return drafts, self.step((sequence[-1], *drafts))

        return decode_together(verifier, generator, count, step)


def decode_together(verifier, generator: torch.Generator, count: int, step) -> list[tuple[int, ...]]:
    """``count`` sequences of LENGTH tokens after token 0, decoded side by side: each round judges every
    unfinished sequence's step (``step(sequence)`` gives its drafts and their verification) in one batched
    call, each sequence a request of its own (test_batched_verification: the same verdicts as one by one)."""
    running, finished = [[0] for _ in range(count)], []
    while running:
        drafted = [step(sequence) for sequence in running]
        verdicts = verifier.verify_batch(batch_steps([verify for _, verify in drafted]), generator=generator)
        still = []
        for sequence, (drafts, _), verdict in zip(running, drafted, verdicts):
            sequence += [drafts[node] for node in verdict.accepted.tolist()] + [verdict.next_token]
            (still if len(sequence) - 1 < LENGTH else finished).append(sequence)
        running = still
    return [tuple(sequence[1 : LENGTH + 1]) for sequence in finished]


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


def speculative_tree_sequences(
    verifier, generator: torch.Generator, target: torch.Tensor, steps: dict[int, tuple[list[int], VerifyInput]], count: int
) -> list[tuple[int, ...]]:
    """Decode ``count`` sequences of LENGTH tokens after token 0, verifying a deterministic tree of drafts per
    step (``steps``: each last token's drafts and verification, built on first use)."""

    def step(sequence: list[int]) -> tuple[list[int], VerifyInput]:
        last = sequence[-1]
        if last not in steps:
            drafts, parents = tree_drafts(last)
            rows = torch.tensor([last, *drafts])
            steps[last] = drafts, VerifyInput(torch.tensor(drafts), torch.tensor(parents), target[rows], SAMPLE)
        return steps[last]

    return decode_together(verifier, generator, count, step)


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
        if tree:
            return Counter(speculative_tree_sequences(verifier, generator, target, {}, DRAWS // SHARES))
        toy = ToyDecoder(deterministic_drafts, target, drafter, reported)
        return Counter(toy.sequences(verifier, generator, DRAWS // SHARES))

    return pooled_chi_square(sum(on_every_core(draw), Counter()), target_joint(target))


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
