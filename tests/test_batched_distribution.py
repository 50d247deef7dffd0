"""Lossless sampling in the batched engine: at batch size 4, each row's sequences under ``rejection`` are
distributed as the target's given that row's own prompt (a chi-square test per row, against the exact
joint), whatever the other rows; a lossy rule in the same batches fails the same test (negative control)."""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest
import torch
from conftest import SHARES, on_every_core, pooled_chi_square, tiny_model

from mars_bench.decoding.batched import decode_batch
from mars_bench.drafting.model import ModelDrafter
from mars_bench.verification import get_verifier

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

VOCAB, LENGTH, DRAWS = 4, 3, 1600  # per row: 1,600 sequences of 3 new tokens over 4 tokens (64 outcomes)
CONTROL_DRAWS = 400  # the negative control's: mars at theta=0.3 gives p < 1e-40 on three rows at 400 already
PROMPTS = [[0], [1, 2], [3, 3, 0, 1], [2, 0, 1]]  # the batch's rows: four prompts of different lengths


def models():
    """A 4-token target and a drafter that agrees with it only part of the time (its weights moved)."""
    target = tiny_model("llama", seed=5, layers=2, vocab=VOCAB)
    drafter = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(6)
    for parameter in drafter.parameters():
        parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return target, drafter


def exact_joint(target, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The target's probability of every LENGTH-token continuation of ``prompt`` at temperature 1."""
    outcomes = list(itertools.product(range(VOCAB), repeat=LENGTH))
    sequences = torch.tensor([[*prompt, *outcome] for outcome in outcomes])
    with torch.no_grad():
        logprobs = torch.log_softmax(target(sequences).logits.double(), -1)
    start = len(prompt) - 1
    picked = logprobs[:, start : start + LENGTH].gather(-1, sequences[:, len(prompt) :, None])[..., 0]
    return dict(zip(outcomes, picked.sum(-1).exp().tolist()))


def row_counts(verifier, draws: int = DRAWS) -> list[Counter]:
    """Per row, the continuations drawn by ``draws`` batches of the four prompts, every row with a seed of its own."""
    target, drafter = models()

    def draw(part: int) -> list[Counter]:
        drafts = ModelDrafter(drafter, VOCAB)
        counts = [Counter() for _ in PROMPTS]
        for index in range(part * draws // SHARES, (part + 1) * draws // SHARES):
            seeds = [index * len(PROMPTS) + row for row in range(len(PROMPTS))]
            results = decode_batch(target, drafts, verifier, PROMPTS, max_new_tokens=LENGTH, gamma=2, temperature=1.0,
                                   seeds=seeds)  # fmt: skip
            for count, result in zip(counts, results):
                count[tuple(result.tokens)] += 1
        return counts

    parts = on_every_core(draw)
    return [sum((part[row] for part in parts), Counter()) for row in range(len(PROMPTS))]


def test_rejection_at_batch_4_keeps_each_rows_target_distribution_and_a_lossy_rule_fails_it():
    target, _ = models()
    joints = [exact_joint(target, prompt) for prompt in PROMPTS]
    assert len({max(joint, key=joint.get) for joint in joints}) > 1  # the rows' distributions differ
    lossless = [pooled_chi_square(counts, joint) for counts, joint in zip(row_counts("rejection"), joints)]
    assert min(lossless) > 1e-3 / len(PROMPTS), lossless  # every row, Bonferroni over the rows
    control = row_counts(get_verifier("mars", theta=0.3), CONTROL_DRAWS)
    lossy = [pooled_chi_square(counts, joint) for counts, joint in zip(control, joints)]
    assert min(lossy) < 1e-6, lossy  # the negative control: the same test catches a lossy rule
