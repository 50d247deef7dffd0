"""Trees of drafts: one tree-masked target forward equals the chains it holds, the KV cache
keeps exactly the accepted path, every verifier walks trees, and tree drafting with
``exact`` decodes exactly like the baseline (fp32, tiny random Llama and Qwen2 models)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from mars_bench import build_drafter, decode
from mars_bench.decoding.engine import block_parents
from mars_bench.drafting.tree import Frontier, TreeShape, expand_tree
from mars_bench.models.kvcache import cached_forward, cached_logits, keep_positions
from mars_bench.verification import Reason, VerifyInput, get_verifier
from mars_bench.verification.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

PARENTS = [-1, -1, 0, 0, 1, 2, 2, 3, 4, 5, 7, 10]  # two root children, paths up to 5 nodes long
PROMPT = torch.tensor([1, 5, 9, 2, 7, 30, 31, 4, 4, 12])
GREEDY, SAMPLE = SamplingParams(), SamplingParams(temperature=1.0)


def path_to(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return tiny_model(request.param, seed=0)


def tree_forward(model, nodes: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    """Logits [1 + N, V] of [last prompt token, nodes...] verified as one tree over the cached prompt."""
    cache = DynamicCache(config=model.config)
    cached_logits(model, PROMPT[:-1], cache)
    block = torch.cat([PROMPT[-1:], nodes])
    logits, _ = cached_forward(model, block, cache, parents=block_parents(torch.tensor(PARENTS)))
    return logits, cache


def test_tree_forward_logits_equal_chain_logits_for_every_path(target):
    nodes = torch.randint(0, 96, (len(PARENTS),), generator=torch.Generator().manual_seed(3))
    logits, _ = tree_forward(target, nodes)
    assert torch.allclose(logits[0], target(input_ids=PROMPT[None]).logits[0, -1], atol=1e-4)
    for node in range(len(PARENTS)):
        chain = torch.cat([PROMPT, nodes[path_to(node)]])
        reference = target(input_ids=chain[None]).logits[0, -1]
        assert (logits[node + 1] - reference).abs().max() < 1e-4, f"node {node}, path {path_to(node)}"


def test_the_cache_keeps_exactly_the_accepted_path(target):
    nodes = torch.randint(0, 96, (len(PARENTS),), generator=torch.Generator().manual_seed(4))
    _, cache = tree_forward(target, nodes)
    path = torch.tensor(path_to(10))  # 0 -> 3 -> 7 -> 10
    keep_positions(cache, torch.cat([torch.arange(len(PROMPT)), len(PROMPT) + path]))
    assert cache.get_seq_length() == len(PROMPT) + len(path)
    following = torch.tensor([17, 23])
    continued = cached_logits(target, following, cache)
    reference = target(input_ids=torch.cat([PROMPT, nodes[path], following])[None]).logits[0, -2:]
    assert (continued - reference).abs().max() < 1e-4


def step(drafts, parents, logits, sampling=GREEDY):
    return VerifyInput(torch.tensor(drafts), torch.tensor(parents), torch.tensor(logits), sampling)


def test_exact_follows_the_child_equal_to_each_argmax():
    logits = [[0, 0, 1, 5, 0], [9, 0, 0, 0, 0], [0, 0, 0, 0, 7], [0, 0, 0, 0, 3], [6, 0, 0, 0, 0]]
    verdict = get_verifier("exact").verify(step([2, 3, 1, 4], [-1, -1, 0, 1], logits))
    assert verdict.accepted.tolist() == [1, 3]  # the second root child, then its child
    assert verdict.next_token == 0  # the argmax after node 3
    assert verdict.decisions.reasons.tolist() == [Reason.EXACT, Reason.EXACT]  # node 3 is a leaf


def test_a_depth_where_every_child_fails_is_reported_once():
    logits = [[0, 0, 0, 0, 5], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    verdict = get_verifier("exact").verify(step([2, 3], [-1, -1], logits))
    assert verdict.accepted_len == 0 and verdict.next_token == 4
    assert verdict.decisions.reasons.tolist() == [Reason.REJECTED]
    decisions = get_verifier("mars").verify(step([2, 3], [-1, -1], logits)).decisions
    assert decisions.reasons.tolist() == [Reason.REJECTED] and decisions.statistics["margin"].tolist() == [0.0]  # row 0's


# Root row: t1 = 3 (logit 10), t2 = 2 (logit 9.5), margin 0.95 > 0.9: relaxation fires.
MARGIN_ROOT = [[0, 0, 9.5, 10, 0], [0, 0, 0, 0, 8], [0, 8, 0, 0, 0]]


def test_mars_takes_the_exact_child_before_an_earlier_relaxed_sibling():
    verdict = get_verifier("mars", theta=0.9).verify(step([2, 3], [-1, -1], MARGIN_ROOT))
    assert verdict.accepted.tolist() == [1] and verdict.next_token == 1
    assert verdict.decisions.reasons.tolist() == [Reason.EXACT]


def test_mars_relaxes_to_the_runner_up_child_when_no_child_is_the_argmax():
    verdict = get_verifier("mars", theta=0.9).verify(step([0, 2], [-1, -1], MARGIN_ROOT))
    assert verdict.accepted.tolist() == [1] and verdict.next_token == 1
    assert verdict.decisions.reasons.tolist() == [Reason.RELAXED]
    strict = get_verifier("mars", theta=None).verify(step([0, 2], [-1, -1], MARGIN_ROOT))
    assert strict.accepted_len == 0 and strict.next_token == 3


def test_mars_ref_takes_the_first_top_two_child_in_tree_order():
    verdict = get_verifier("mars_ref", theta=0.9).verify(
        step([2, 3], [-1, -1], MARGIN_ROOT, SAMPLE), generator=torch.Generator().manual_seed(0)
    )
    assert verdict.accepted.tolist() == [0]  # token 2 (t2), drafted before t1
    assert verdict.decisions.reasons.tolist() == [Reason.RELAXED]


def test_rejection_emits_a_token_no_rejected_sibling_carries():
    # Both root children are impossible under the target, so both are rejected and the
    # correction comes from p without them.
    logits = [[5, -30, -30, 0, 0], [0] * 5, [0] * 5]
    for seed in range(20):
        verdict = get_verifier("rejection").verify(
            step([1, 2], [-1, -1], logits, SAMPLE), generator=torch.Generator().manual_seed(seed)
        )
        assert verdict.accepted_len == 0 and verdict.next_token in (0, 3, 4)


@pytest.mark.parametrize("name", ["exact", "rejection", "mars", "mars_ref", "typical"])
def test_every_verifier_returns_a_root_to_leaf_path(name):
    generator = torch.Generator().manual_seed(5)
    for trial in range(20):
        logits = torch.randn(len(PARENTS) + 1, 6, generator=generator) * 3
        drafts = [int(t) for t in torch.randint(0, 6, (len(PARENTS),), generator=generator)]
        for index, parent in enumerate(PARENTS):  # siblings carry distinct tokens
            while any(PARENTS[j] == parent and drafts[j] == drafts[index] for j in range(index)):
                drafts[index] = (drafts[index] + 1) % 6
        for sampling in (GREEDY, SAMPLE):
            verdict = get_verifier(name).verify(
                VerifyInput(torch.tensor(drafts), torch.tensor(PARENTS), logits, sampling), generator=generator
            )
            path = verdict.accepted.tolist()
            assert [PARENTS[node] for node in path] == [-1, *path][: len(path)], f"trial {trial}: {path}"
            assert len(verdict.decisions.reasons) in (len(path), len(path) + 1)


def test_tree_drafts_with_sampled_distributions_are_refused():
    tree = VerifyInput(torch.tensor([1, 2]), torch.tensor([-1, -1]), torch.zeros(3, 4), SAMPLE, draft_dists=torch.ones(2, 4) / 4)
    with pytest.raises(ValueError, match="draft_dists with a tree of drafts is not supported"):
        get_verifier("rejection").verify(tree)


def test_siblings_with_the_same_token_are_refused():
    with pytest.raises(ValueError, match="two siblings carry the same token"):
        get_verifier("rejection").verify(step([1, 1], [-1, -1], [[0.0] * 4] * 3, SAMPLE))


def test_trees_need_an_attention_that_applies_the_4d_mask():
    from types import SimpleNamespace

    from mars_bench.models.kvcache import check_tree_attention

    for implementation in ("eager", "sdpa"):
        check_tree_attention(SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation)))
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' cannot verify or draft trees"):
        check_tree_attention(flash)


def test_parents_out_of_topological_order_are_refused():
    with pytest.raises(ValueError, match=r"parents\[0\]=1 is invalid"):
        get_verifier("exact").verify(step([1, 2], [1, -1], [[0.0] * 4] * 3))


def test_the_expansion_keeps_the_best_nodes_with_their_ancestors():
    generator = torch.Generator().manual_seed(0)

    def next_logprobs(frontier: Frontier) -> torch.Tensor:
        return torch.log_softmax(torch.randn(frontier.nodes.shape[0], 30, generator=generator) * 2, -1)

    shape = TreeShape(depth=4, top_k=3, tree_tokens=12)
    tree = expand_tree(torch.log_softmax(torch.randn(30, generator=generator), -1), next_logprobs, shape)
    parents, scores, tokens = tree.parents.tolist(), tree.scores.tolist(), tree.tokens.tolist()
    assert len(parents) == 11
    assert all(parent < node for node, parent in enumerate(parents))
    assert all(scores[node] <= scores[parent] for node, parent in enumerate(parents) if parent >= 0)
    for parent in set(parents):
        children = [tokens[node] for node, p in enumerate(parents) if p == parent]
        assert len(children) == len(set(children)) <= 3


def test_a_tree_budget_smaller_than_the_depth_is_refused():
    with pytest.raises(ValueError, match=r"tree_tokens=5 is invalid for depth 6: allowed is an integer >= depth \+ 1 = 7"):
        TreeShape(depth=6, top_k=10, tree_tokens=5)


PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3], [11]]


def test_a_step_deeper_than_the_node_budget_keeps_the_budget_and_caps_the_depth(target):
    drafter = build_drafter("model_tree", model=target, top_k=1, tree_tokens=4)  # top_k 1: a chain as deep as allowed
    drafter.begin([torch.tensor(PROMPTS[0])])
    (deep,) = drafter.propose([torch.tensor(PROMPTS[0])], [8], SamplingParams(), [None])
    assert deep.parents.tolist() == [-1, 0, 1]  # depth 8 asked, the 3-node budget kept
    drafter.begin([torch.tensor(PROMPTS[0])])
    (shallow,) = drafter.propose([torch.tensor(PROMPTS[0])], [2], SamplingParams(), [None])
    assert shallow.parents.tolist() == [-1, 0]  # within the budget the depth asked for is kept


@pytest.mark.parametrize(("gamma", "top_k", "tree_tokens"), [(1, 2, 3), (3, 2, 6), (5, 3, 16)])
@pytest.mark.slow
def test_exact_over_trees_reproduces_the_baseline(target, gamma, top_k, tree_tokens):
    other = tiny_model("llama", seed=7, layers=2)
    drafter = build_drafter("model_tree", model=other, vocab_size=96, top_k=top_k, tree_tokens=tree_tokens)
    for prompt in PROMPTS:
        baseline = decode(target, None, None, prompt, max_new_tokens=40)
        result = decode(target, drafter, "exact", prompt, max_new_tokens=40, gamma=gamma)
        assert result.tokens == baseline.tokens, f"gamma={gamma} top_k={top_k} prompt={prompt}"
        assert max(step.drafted for step in result.steps) <= tree_tokens - 1
        accepted, reached = result.accepted_per_depth()
        assert len(reached) <= gamma and reached[0] == sum(step.drafted > 0 for step in result.steps)  # per depth, not node


def test_a_tree_drafted_by_the_target_itself_always_keeps_its_top_choice(target):
    # The root's most likely child is the target's own argmax, so every step keeps at least
    # one draft; deeper nodes survive the budget only when their path scores are high.
    drafter = build_drafter("model_tree", model=target, top_k=2, tree_tokens=8)
    result = decode(target, drafter, "exact", PROMPTS[1], max_new_tokens=31, gamma=4)
    assert all(step.accepted >= 1 for step in result.steps)
    assert result.tau > 2


@pytest.mark.parametrize("name", ["rejection", "mars", "mars_ref", "typical"])
@pytest.mark.slow
def test_sampling_over_trees_is_reproducible_by_seed(target, name):
    other = tiny_model("llama", seed=7, layers=2)
    drafter = build_drafter("model_tree", model=other, vocab_size=96, top_k=3, tree_tokens=10)
    runs = [decode(target, drafter, name, PROMPTS[0], max_new_tokens=30, gamma=4, temperature=1.0, seed=s) for s in (9, 9, 10)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 30
    assert runs[2].tokens != runs[0].tokens  # the seed, not something fixed, decides
