"""EAGLE-3 drafter: a randomly initialised head saved in the official layout loads and drafts
valid trees; its tree forward equals each path run as a chain; bad heads fail with one-line
messages; with the engine, ``exact`` reproduces the baseline token for token (fp32)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import save_file

from mars_bench import build_drafter, decode
from mars_bench.common.trees import node_depths
from mars_bench.drafting.eagle3 import (
    Eagle3Drafter,
    Eagle3Head,
    Eagle3Settings,
    eagle3_hidden_layers,
    head_shapes,
    load_eagle3_head,
    random_head_state,
)
from mars_bench.verification.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

VOCAB, DRAFT_VOCAB, HIDDEN = 96, 40, 64
PROMPT = [1, 5, 9, 2, 7, 33, 12, 5, 9]
GREEDY = SamplingParams()
DEVICE = os.environ.get("MARS_BENCH_TEST_DEVICE", "cpu")  # "cuda" runs these checks on a GPU


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=4, vocab=VOCAB).to(DEVICE)


def head_config(**overrides: object) -> dict[str, object]:
    """A tiny config.json with the published head's fields (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
    }
    config.update(overrides)
    return config


def head_state(config: dict[str, object], seed: int = 0) -> dict[str, torch.Tensor]:
    return random_head_state(config, seed)


def eagle3(target, head=None, **settings) -> Eagle3Drafter:
    return build_drafter("eagle3", target=target, head=head, **settings)


class RecordingDrafter(Eagle3Drafter):
    """Keeps what the last ``propose`` of one sequence computed: ``root_seen`` (the head's draft logits and hidden
    after the context), ``grown`` (the whole tree before pruning to tree_tokens - 1 nodes) and ``outputs``
    {node of grown: (draft logits, hidden)} for every node fed to the head."""

    def propose(self, *args, **kwargs):
        self.grown, self.outputs = None, {}
        return super().propose(*args, **kwargs)

    def root_outputs(self, contexts):
        logits, hidden = super().root_outputs(contexts)
        self.root_seen = (logits[0], hidden[0])
        return logits, hidden

    def feed_frontiers(self, frontiers, parent_hidden, context):
        logits, hidden = super().feed_frontiers(frontiers, parent_hidden, context)
        self.grown = frontiers.trees.row(0)
        self.outputs.update({node: (logits[0, row], hidden[0, row]) for row, node in enumerate(frontiers.nodes[0].tolist())})
        return logits, hidden

    def grown_lists(self) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, q) of every grown node, in creation order."""
        tree = self.grown
        size = tree.size
        return tree.tokens[:size].tolist(), tree.parents[:size].tolist(), tree.logq[:size].exp().tolist()


def recording(target, head_dir, top_k: int, tree_tokens: int) -> RecordingDrafter:
    return RecordingDrafter(target, load_eagle3_head(str(head_dir), target), Eagle3Settings(top_k, tree_tokens))


def save_head(folder, config, state, fmt: str = "safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({key: value.contiguous() for key, value in state.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return save_head(tmp_path_factory.mktemp("eagle3") / "head", head_config(), head_state(head_config()))


def features(target, drafter: Eagle3Drafter, ids: list[int]) -> torch.Tensor:
    """The fused rows the engine hands over: the drafter's hidden-state entries, concatenated."""
    out = target(torch.tensor([ids], device=target.device), output_hidden_states=True)
    return torch.cat([out.hidden_states[index][0] for index in drafter.hidden_layers], dim=-1)


def next_token(target, ids: list[int]) -> int:
    return int(target(torch.tensor([ids], device=target.device)).logits[0, -1].argmax())


def started(target, drafter: Eagle3Drafter, prompt: list[int]) -> list[int]:
    """Begin like the engine: prefill, choose the first token; returns the context."""
    drafter.begin([torch.tensor(prompt)], [features(target, drafter, prompt)])
    return prompt + [next_token(target, prompt)]


def check_tree(draft, max_drafts: int, tree_tokens: int, used: set[int]) -> None:
    count = len(draft)
    assert 0 < count <= tree_tokens - 1
    assert draft.parents.device.type == "cpu" and draft.parents.dtype == torch.long
    assert draft.dists is None and draft.tokens.dtype == torch.long
    parents = draft.parents.tolist()
    assert all(-1 <= parent < index for index, parent in enumerate(parents))  # topological
    assert int(node_depths(draft.parents).max()) <= max_drafts - 1  # depth 0 = a child of the root
    tokens = draft.tokens.tolist()
    assert all(0 <= token < VOCAB for token in tokens) and set(tokens) <= used
    assert bool(((draft.probs > 0) & (draft.probs <= 1)).all())
    siblings = [(parent, token) for parent, token in zip(parents, tokens)]
    assert len(set(siblings)) == count  # no node has two children with the same token


def test_hidden_layer_indices_follow_the_official_rule():
    assert eagle3_hidden_layers(32) == (2, 16, 29)  # Llama-3.1-8B: inputs of decoder layers 2, 16, 29
    assert eagle3_hidden_layers(80) == (2, 40, 77)
    assert eagle3_hidden_layers(4) == (1, 2, 2)  # tiny targets keep three entries
    assert eagle3_hidden_layers(94, [1, 46, 90]) == (2, 47, 91)  # eagle_config ids are layer outputs
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        eagle3_hidden_layers(2)


@pytest.mark.parametrize("overrides", [{}, {"head_dim": 8, "target_hidden_size": 32, "num_key_value_heads": 1}])
def test_the_shape_table_is_the_heads_own_layout(overrides):
    """The loader's checks and the random weights use ``head_shapes``; the head's modules must agree."""
    from transformers import LlamaConfig

    config = head_config(**overrides)
    shapes = head_shapes(config)
    head = Eagle3Head(LlamaConfig.from_dict(config), shapes["fc.weight"][1], DRAFT_VOCAB, own_embed=True)
    assert {key: tuple(value.shape) for key, value in head.state_dict().items()} == shapes


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_head_in_the_official_layout_loads_and_drafts_a_valid_tree(target, tmp_path, fmt):
    state = head_state(head_config())
    folder = save_head(tmp_path / fmt, head_config(), state, fmt)
    used = set((torch.arange(DRAFT_VOCAB) + state["d2t"]).tolist())
    drafter = eagle3(target, head=str(folder), top_k=4, tree_tokens=12)
    assert drafter.hidden_layers == (1, 2, 2)
    assert drafter.describe() == {
        "name": "eagle3",
        "head": str(folder),
        "top_k": 4,
        "tree_tokens": 12,
        "hidden_layers": [1, 2, 2],
        "draft_vocab_size": DRAFT_VOCAB,
        "device": str(drafter.head.fc.weight.device),
    }
    head = drafter.head
    assert head.embed_tokens is None and head.embed(torch.tensor([3]), head.fc.weight).shape == (1, HIDDEN)
    assert torch.equal(head.lm_head.weight.cpu(), state["lm_head.weight"]) and torch.equal(head.d2t.cpu(), state["d2t"])
    context = started(target, drafter, PROMPT)
    for max_drafts in (1, 3, 5):
        draft = drafter.propose([torch.tensor(context)], [max_drafts], GREEDY, [None])[0]
        check_tree(draft, max_drafts, 12, used)
        assert draft.tokens.device == target.get_input_embeddings().weight.device
        assert head.cache_length == len(context) - 1  # only committed pairs stay cached
    # Drafting is top-k, the same in sampling mode.
    sampled = drafter.propose([torch.tensor(context)], [5], SamplingParams(temperature=0.8, top_p=0.9), [torch.Generator()])[0]
    assert torch.equal(sampled.tokens, draft.tokens) and torch.equal(sampled.parents, draft.parents)


def test_accepting_feeds_the_committed_pairs_as_a_from_scratch_run_would(target, head_dir):
    drafter = recording(target, head_dir, top_k=3, tree_tokens=10)
    reference = recording(target, head_dir, top_k=3, tree_tokens=10)  # its own head and cache
    context = started(target, drafter, PROMPT)
    for _ in range(4):
        draft = drafter.propose([torch.tensor(context)], [4], GREEDY, [None])[0]
        parents = draft.parents.tolist()
        path = [len(parents) - 1]  # accept the path to the last node
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        kept = context + [int(draft.tokens[node]) for node in path]
        drafter.accept([path], [features(target, drafter, kept)[len(context) - 1 :]])  # the root's row, then the path's
        context = kept + [next_token(target, kept)]
        drafter.propose([torch.tensor(context)], [4], GREEDY, [None])
        assert drafter.head.cache_length == len(context) - 1
        reference.begin([torch.tensor(context[:-1])], [features(target, reference, context[:-1])])
        reference.propose([torch.tensor(context)], [4], GREEDY, [None])
        for mine, fresh in zip(drafter.root_seen, reference.root_seen):
            assert (mine - fresh).abs().max() < 1e-4


def test_the_tree_forward_equals_each_path_run_as_a_chain(target, head_dir):
    drafter = recording(target, head_dir, top_k=3, tree_tokens=20)
    context = started(target, drafter, PROMPT)
    drafter.propose([torch.tensor(context)], [5], GREEDY, [None])
    head, outputs = drafter.head, drafter.outputs
    tokens, parents, probs = drafter.grown_lists()
    root_logits, root_hidden = drafter.root_seen
    committed = head.cache_length
    assert committed == len(context) - 1 and len(outputs) == 3 * 4  # top_k frontier nodes at depths 0..3
    depths = [0 if parent < 0 else None for parent in parents]
    for node in range(len(parents)):
        depths[node] = 0 if parents[node] < 0 else depths[parents[node]] + 1
    worst = 0.0
    for node, (tree_logits, tree_hidden) in outputs.items():
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        hidden = root_hidden
        for step, member in enumerate(path):
            assert depths[member] == step
            token = torch.tensor([tokens[member]])
            logits, hidden = head(token, hidden[None], torch.tensor([committed + step]))
            logits, hidden = logits[0], hidden[0]
        head.truncate(committed)
        worst = max(worst, float((logits - tree_logits).abs().max()), float((hidden - tree_hidden).abs().max()))
    assert worst < 1e-4
    # q of every grown node: the head's softmax probability of its token after its parent.
    for node in range(len(parents)):
        parent = parents[node]
        parent_logits = root_logits if parent < 0 else outputs[parent][0]
        expected = head.target_logprobs(parent_logits[None])[0, tokens[node]].exp()
        assert abs(float(expected) - probs[node]) < 1e-5


def test_a_mask_that_ignores_the_tree_changes_the_outputs(target, head_dir):
    """Negative control for the test above: the same nodes fed with plain causal attention differ."""
    drafter = recording(target, head_dir, top_k=3, tree_tokens=20)
    context = started(target, drafter, PROMPT)
    drafter.propose([torch.tensor(context)], [3], GREEDY, [None])
    head, outputs = drafter.head, drafter.outputs
    tokens, parents, _ = drafter.grown_lists()
    committed = head.cache_length
    nodes = list(outputs)
    hidden_in = torch.stack([drafter.root_seen[1] if parents[n] < 0 else outputs[parents[n]][1] for n in nodes])
    positions = torch.tensor([committed + (0 if parents[n] < 0 else 1) for n in nodes])
    logits, _ = head(torch.tensor([tokens[n] for n in nodes]), hidden_in, positions)  # causal over all nodes
    head.truncate(committed)
    assert float((logits - torch.stack([outputs[n][0] for n in nodes])).abs().max()) > 1e-2


def one_line_error(target, tmp_path, config, state, match: str) -> None:
    folder = save_head(tmp_path / "bad", config, state)
    with pytest.raises(ValueError, match=match) as error:
        load_eagle3_head(str(folder), target)
    assert "\n" not in str(error.value)


def test_a_head_for_another_hidden_size_is_refused(target, tmp_path):
    config = head_config(hidden_size=32, intermediate_size=48)
    one_line_error(target, tmp_path, config, head_state(config), r"hidden_size=32 .*target's hidden_size=64")


def test_a_head_for_another_vocabulary_is_refused(target, tmp_path):
    config = head_config(vocab_size=100)
    one_line_error(target, tmp_path, config, head_state(config), r"vocab_size=100 .*target's vocab_size=96")


def test_a_vocabulary_map_outside_the_target_is_refused(target, tmp_path):
    state = head_state(head_config())
    state["d2t"][-1] += VOCAB  # the last draft id now maps past the target's vocabulary
    one_line_error(target, tmp_path, head_config(), state, r"d2t maps draft ids to target ids in \[\d+, \d+\].*\[0, 95\]")


def test_missing_and_unexpected_keys_are_named(target, tmp_path):
    state = head_state(head_config())
    del state["midlayer.mlp.up_proj.weight"], state["d2t"]
    one_line_error(target, tmp_path, head_config(), state, r"missing keys midlayer\.mlp\.up_proj\.weight, d2t")
    state = head_state(head_config())
    state["fc.bias"] = torch.zeros(HIDDEN)
    one_line_error(target, tmp_path, head_config(), state, r"unexpected keys fc\.bias")
    state = head_state(head_config())
    state["fc.weight"] = state["fc.weight"][:, :HIDDEN]
    one_line_error(target, tmp_path, head_config(), state, r"fc\.weight has shape \[64, 64\]: allowed is \[64, 192\]")


def test_a_head_with_the_full_vocabulary_needs_no_map_and_may_carry_embeddings(target, tmp_path):
    config = head_config(draft_vocab_size=VOCAB)
    state = head_state(config)
    del state["d2t"], state["t2d"]
    state["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)
    head = load_eagle3_head(str(save_head(tmp_path / "full", config, state)), target)
    assert torch.equal(head.draft_ids.cpu(), torch.arange(VOCAB)) and bool(head.t2d.all())
    assert torch.equal(head.embed_tokens.weight.cpu(), state["embed_tokens.weight"])


def test_no_head_is_a_clear_error(target):
    with pytest.raises(ValueError, match="head=None") as error:
        eagle3(target)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="not-a-folder"):
        eagle3(target, head="./not-a-folder")


def test_a_hub_id_is_fetched_with_snapshot_download(target, head_dir, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **_):
        calls.append((repo_id, allow_patterns))
        return str(head_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    drafter = eagle3(target, head="someone/eagle3-head")
    assert drafter.describe()["head"] == "someone/eagle3-head"
    [(repo_id, patterns)] = calls
    assert repo_id == "someone/eagle3-head" and {"config.json", "*.safetensors", "pytorch_model*.bin"} <= set(patterns)


def test_the_drafter_refuses_to_run_without_features(target, head_dir):
    drafter = eagle3(target, head=str(head_dir))
    with pytest.raises(ValueError, match="features"):
        drafter.begin([torch.tensor(PROMPT)])


@pytest.mark.parametrize("prompt", [PROMPT, [11], [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3]])
def test_exact_with_eagle3_reproduces_the_baseline(target, head_dir, prompt):
    """The engine passes the features and verifies the tree (Draft.parents) in one target forward."""
    baseline = decode(target, None, None, prompt, max_new_tokens=24, temperature=0)
    for gamma, top_k, tree_tokens in ((3, 4, 10), (7, 10, 50)):  # the second is conf/drafter/eagle3.yaml
        drafter = eagle3(target, head=str(head_dir), top_k=top_k, tree_tokens=tree_tokens)
        result = decode(target, drafter, "exact", prompt, max_new_tokens=24, gamma=gamma, temperature=0)
        assert result.tokens == baseline.tokens, f"gamma={gamma} top_k={top_k} tree_tokens={tree_tokens}"
