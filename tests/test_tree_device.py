"""Tree drafting and tree verification without a host sync per depth.

The device-side expansion (``expand_tree``) grows exactly the tree of a plain host-side
reference (the list-based expansion it replaced) on random log-probabilities, with the same
frontier masks; the tree drafters' ``propose`` reads the device once per step, whatever the
depth; a tree verdict reaches the host in one transfer; the target's tree mask built on the
device equals the host-built one.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
import torch
from conftest import HostSyncs, OnDevice, tiny_model

from mars_bench import build_drafter
from mars_bench.common.trees import device_tree_structure, node_depths
from mars_bench.drafting.eagle3 import Eagle3Drafter, Eagle3Settings, eagle3_head_from_state, random_head_state
from mars_bench.drafting.tree import Frontier, TreeShape, expand_tree
from mars_bench.models.kvcache import tree_attention
from mars_bench.verification import VerifyInput, available_verifiers, batch_steps, get_verifier
from mars_bench.verification.sampling import SamplingParams

COMMITTED = 3  # context positions cached before the tree, for the frontier masks


# --- the reference: the host-side expansion, one node at a time ---------------------------


@dataclass
class HostTree:
    """A tree as Python lists, in node creation order."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float, prob: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.probs.append(prob)
        self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def best(self, count: int) -> HostTree:
        kept = sorted(sorted(range(len(self.tokens)), key=lambda node: -self.scores[node])[:count])
        renumber = {old: new for new, old in enumerate(kept)}
        tree = HostTree()
        for old in kept:
            parent = self.parents[old]
            tree.add(self.tokens[old], renumber[parent] if parent >= 0 else -1, self.scores[old], self.probs[old])
        return tree


def host_frontier_block(tree: HostTree, frontier: list[int], fed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed [F, COMMITTED + len(fed) + F], positions [F]) walked node by node."""
    slot = {node: index for index, node in enumerate(fed)}
    allowed = torch.zeros(len(frontier), COMMITTED + len(fed) + len(frontier), dtype=torch.bool)
    allowed[:, :COMMITTED] = True
    for row, node in enumerate(frontier):
        allowed[row, COMMITTED + len(fed) + row] = True
        ancestor = tree.parents[node]
        while ancestor >= 0:
            allowed[row, COMMITTED + slot[ancestor]] = True
            ancestor = tree.parents[ancestor]
    return allowed, torch.tensor([COMMITTED + tree.depths[node] for node in frontier])


def host_expand(root: torch.Tensor, logprobs_for, shape: TreeShape, seen: list) -> HostTree:
    """The EAGLE-2 expansion on the host; ``seen`` gets each fed frontier's (tokens, allowed, positions)."""
    tree, fed = HostTree(), []
    values, tokens = torch.topk(root.float(), min(shape.top_k, root.shape[-1]))
    frontier = [tree.add(t, -1, v, math.exp(v)) for v, t in zip(values.tolist(), tokens.tolist())]
    for _ in range(shape.depth - 1):
        seen.append(([tree.tokens[node] for node in frontier], *host_frontier_block(tree, frontier, fed)))
        fed += frontier
        logprobs = logprobs_for(len(frontier)).float()
        child_values, child_tokens = torch.topk(logprobs, min(shape.top_k, logprobs.shape[-1]), dim=-1)
        totals = torch.tensor([tree.scores[node] for node in frontier])[:, None] + child_values
        children = [
            tree.add(token, frontier[row], total, math.exp(value))
            for row in range(len(frontier))
            for token, total, value in zip(child_tokens[row].tolist(), totals[row].tolist(), child_values[row].tolist())
        ]
        best = torch.topk(totals.flatten(), min(shape.top_k, totals.numel())).indices.tolist()
        frontier = [children[index] for index in sorted(best)]
    return tree.best(shape.nodes)


class RandomLogprobs:
    """Log-probabilities [F, V] drawn in call order from a seeded generator; ``step`` > 0 rounds
    them to multiples of ``step`` so that many paths tie."""

    def __init__(self, seed: int, vocab: int, step: float = 0.0) -> None:
        self.generator, self.vocab, self.step = torch.Generator().manual_seed(seed), vocab, step

    def __call__(self, rows: int) -> torch.Tensor:
        logprobs = torch.log_softmax(torch.randn(rows, self.vocab, generator=self.generator) * 3, dim=-1)
        return (logprobs / self.step).round() * self.step if self.step else logprobs


SHAPES = [  # (depth, top_k, tree_tokens, vocab, tie step)
    (1, 3, 4, 20, 0.0),
    (2, 2, 3, 20, 0.0),
    (4, 3, 12, 30, 0.0),
    (5, 4, 30, 50, 0.0),
    (7, 10, 50, 64, 0.0),  # the MARS paper's setting
    (6, 1, 7, 10, 0.0),  # top_k 1: a chain
    (3, 6, 40, 4, 0.0),  # top_k above the vocabulary
    (5, 3, 20, 12, 0.5),  # coarse log-probabilities: ties in every selection
    (4, 4, 9, 16, 1.0),
]


@pytest.mark.parametrize(("depth", "top_k", "tree_tokens", "vocab", "tie"), SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_device_expansion_grows_the_reference_tree(depth, top_k, tree_tokens, vocab, tie, seed):
    shape = TreeShape(depth, top_k, tree_tokens)
    root = RandomLogprobs(seed + 100, vocab, tie)(1)[0]
    host_seen: list = []
    reference = host_expand(root, RandomLogprobs(seed, vocab, tie), shape, host_seen)

    device_seen: list = []
    inputs = RandomLogprobs(seed, vocab, tie)

    def next_logprobs(frontier: Frontier) -> torch.Tensor:
        device_seen.append((frontier.tokens.tolist(), *frontier.attention(COMMITTED)))
        return inputs(frontier.nodes.shape[0])

    tree = expand_tree(root, next_logprobs, shape)
    assert tree.tokens.tolist() == reference.tokens
    assert tree.parents.tolist() == reference.parents
    assert tree.scores.tolist() == reference.scores  # float32 values, bit for bit
    assert torch.equal(tree.probs, torch.tensor(reference.probs, dtype=torch.float32))
    assert len(device_seen) == len(host_seen) == depth - 1
    for (tokens, allowed, positions), (host_tokens, host_allowed, host_positions) in zip(device_seen, host_seen):
        assert tokens == host_tokens
        assert torch.equal(allowed, host_allowed) and torch.equal(positions, host_positions)


def test_the_draft_carries_the_tree_and_one_host_copy_of_its_tokens():
    generator = torch.Generator().manual_seed(0)
    tree = expand_tree(
        torch.log_softmax(torch.randn(40, generator=generator), -1),
        lambda frontier: torch.log_softmax(torch.randn(frontier.nodes.shape[0], 40, generator=generator), -1),
        TreeShape(4, 3, 10),
    )
    draft = tree.to_draft("cpu")
    assert draft.parents.device.type == "cpu" and torch.equal(draft.parents, tree.parents)
    assert torch.equal(draft.host_tokens, tree.tokens) and draft.token_list() == tree.tokens.tolist()
    assert torch.equal(draft.probs, tree.probs) and len(draft) == 9


# --- the target's tree mask ----------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 2, 7, 50])
def test_the_device_tree_structure_equals_the_host_one(count):
    generator = torch.Generator().manual_seed(count)
    for _ in range(20):
        parents = [int(torch.randint(-1, node, (), generator=generator)) for node in range(count)]
        depths, ancestors = device_tree_structure(torch.tensor(parents, dtype=torch.long))
        host_ancestors = torch.eye(count, dtype=torch.bool)
        for node, parent in enumerate(parents):  # a node's ancestors: its parent's, and its parent
            if parent >= 0:
                host_ancestors[node] |= host_ancestors[parent]
        assert torch.equal(depths, node_depths(torch.tensor(parents, dtype=torch.long)))
        assert torch.equal(ancestors, host_ancestors)
    chain = torch.arange(-1, count - 1)
    assert device_tree_structure(chain)[0].tolist() == list(range(count))


def test_the_tree_attention_mask_covers_the_prefix_the_ancestors_and_the_node():
    allowed, positions = tree_attention(torch.tensor([-1, 0, 0, 1]), 2, "cpu")
    assert allowed.tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, False, True, False],
        [True, True, True, True, False, True],
    ]
    assert positions.tolist() == [2, 3, 3, 4]


# --- counting host syncs ---------------------------------------------------------------------

def eagle3_drafter(top_k: int, tree_tokens: int) -> tuple[Eagle3Drafter, torch.nn.Module]:
    target = tiny_model("llama", layers=4, vocab=96)
    config = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "vocab_size": 96, "draft_vocab_size": 40, "rms_norm_eps": 1e-5}  # fmt: skip
    head = eagle3_head_from_state(config, random_head_state(config, 0), target, dtype=torch.float32, device="cpu")
    return Eagle3Drafter(target, head, Eagle3Settings(top_k, tree_tokens)), target


def begun(name: str, prompt: torch.Tensor):
    """A tree drafter of each kind, begun on ``prompt`` as the engine begins it."""
    if name == "model_tree":
        drafter = build_drafter("model_tree", model=tiny_model("llama", seed=7, layers=2), vocab_size=96, top_k=3, tree_tokens=20)
        drafter.begin([prompt])
        return drafter
    drafter, target = eagle3_drafter(top_k=3, tree_tokens=20)
    out = target(prompt[None], output_hidden_states=True)
    drafter.begin([prompt], [torch.cat([out.hidden_states[i][0] for i in drafter.hidden_layers], dim=-1)])
    return drafter


@pytest.mark.parametrize("name", ["model_tree", "eagle3"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)])
def test_a_tree_drafter_reads_the_device_once_per_step_whatever_the_depth(name, sampling):
    prompt = torch.tensor([1, 5, 9, 2, 7, 33, 12])
    context = torch.cat([prompt, torch.tensor([4])])
    for depth in (1, 2, 4, 6):
        drafter = begun(name, prompt)
        with torch.inference_mode(), HostSyncs() as syncs:
            (draft,) = drafter.propose([context], [depth], sampling, [torch.Generator().manual_seed(0)])
        assert syncs.calls == Counter({"cpu": 1}), f"{name} depth {depth}: {dict(syncs.calls)}"
        assert int(draft.parents.max()) < len(draft) and draft.token_list() == draft.tokens.tolist()


TREE_VERIFIERS = [name for name in available_verifiers() if not get_verifier(name).chains_only]


@pytest.mark.parametrize("name", TREE_VERIFIERS)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)])
def test_a_tree_verdict_reaches_the_host_in_one_transfer(name, sampling):
    generator = torch.Generator().manual_seed(3)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 3, 4, 5, 7, 10])
    count = parents.shape[0]
    logits = torch.randn(count + 1, 24, generator=generator) * 3
    drafts = torch.randperm(24, generator=generator)[:count]  # distinct, so siblings differ
    probs = torch.rand(count, generator=generator)
    step = VerifyInput(
        drafts.as_subclass(OnDevice), parents, logits.as_subclass(OnDevice), sampling, draft_probs=probs.as_subclass(OnDevice)
    )
    verifier = get_verifier(name)
    with torch.inference_mode(), HostSyncs(only_on_device=True) as syncs:
        verdict = verifier.verify(step, generator=torch.Generator().manual_seed(1))
    assert syncs.count == 1, dict(syncs.calls)
    plain = VerifyInput(drafts, parents, logits, sampling, draft_probs=probs)
    expected = verifier.verify(plain, generator=torch.Generator().manual_seed(1))
    assert torch.equal(verdict.accepted, expected.accepted) and verdict.next_token == expected.next_token


def ragged_batch(chains_only: bool, sampling: SamplingParams) -> list[VerifyInput]:
    """Four requests' steps of different shapes: a tree (or a chain), a longer chain, no drafts, one draft."""
    generator = torch.Generator().manual_seed(4)
    shapes = [[-1, 0, 1] if chains_only else [-1, -1, 0, 1, 1], [-1, 0, 1, 2, 3], [], [-1]]
    steps = []
    for parents in shapes:
        logits = torch.randn(len(parents) + 1, 24, generator=generator) * 3
        drafts = torch.randperm(24, generator=generator)[: len(parents)]
        probs = torch.rand(len(parents), generator=generator)
        steps.append(VerifyInput(drafts, torch.tensor(parents, dtype=torch.long), logits, sampling, draft_probs=probs))
    return steps


@pytest.mark.parametrize("name", available_verifiers())
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)])
def test_a_batch_of_four_requests_reaches_the_host_in_one_transfer(name, sampling):
    verifier = get_verifier(name)
    batch = batch_steps(ragged_batch(verifier.chains_only, sampling))
    on_device = replace(batch, draft_tokens=batch.draft_tokens.as_subclass(OnDevice),
                        target_logits=batch.target_logits.as_subclass(OnDevice),
                        draft_probs=batch.draft_probs.as_subclass(OnDevice))  # fmt: skip
    streams = [torch.Generator().manual_seed(request) for request in range(4)]
    with torch.inference_mode(), HostSyncs(only_on_device=True) as syncs:
        verdicts = verifier.verify_batch(on_device, generator=streams)
    assert syncs.count == 1, dict(syncs.calls)
    expected = verifier.verify_batch(batch, generator=[torch.Generator().manual_seed(request) for request in range(4)])
    assert [(v.accepted.tolist(), v.next_token) for v in verdicts] == [(v.accepted.tolist(), v.next_token) for v in expected]
