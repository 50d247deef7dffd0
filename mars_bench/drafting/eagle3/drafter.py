"""The ``eagle3`` drafter: an EAGLE-3 head grows an EAGLE-2 style dynamic tree per step.

How EAGLE drafts with the head, and the sources: ``docs/eagle3.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mars_bench.drafting.base import Draft, Drafter, DrafterContext, register_drafter
from mars_bench.drafting.eagle3.checkpoint import load_eagle3_head, target_sizes
from mars_bench.drafting.eagle3.head import Eagle3Head, eagle3_hidden_layers
from mars_bench.drafting.tree import Frontier, TreeSettings, TreeShape, expand_tree
from mars_bench.models.placement import input_device
from mars_bench.verification.sampling import SamplingParams


@dataclass(frozen=True)
class Eagle3Settings(TreeSettings):
    """eagle3: EAGLE's --top-k 10 and --total-token 50, as the MARS paper runs it
    (conf/drafter/eagle3.yaml)."""

    top_k: int = 10
    tree_tokens: int = 50


class Eagle3Drafter(Drafter):
    """Drafts an EAGLE-2 style dynamic tree with an EAGLE-3 head.

    The head's cache holds one pair (feature_i, token_{i+1}) per committed token but the newest,
    at position i. Features arrive from the engine (``begin``: the prompt's rows; ``accept``: the
    root's and the accepted nodes' rows) and are fed lazily at the next ``propose``, as a chain;
    its last output is the root (``root_outputs``). The tree then grows depth by depth
    (``expand_tree``), each depth one head forward over the frontier (``feed_frontier``), and its
    nodes leave the cache afterwards. Drafting is top-k (deterministic) at every temperature;
    ``probs`` is the head's softmax probability of each node's token given its parent.

    head_name: the head's folder or Hub id, for the records (None for a head built in memory).
    """

    name = "eagle3"

    def __init__(self, target: Any, head: Eagle3Head, settings: Eagle3Settings | None = None, head_name: str | None = None):
        settings = settings or Eagle3Settings()
        if settings.top_k > head.draft_vocab_size:
            raise ValueError(
                f"drafter.top_k={settings.top_k} is invalid for this head: "
                f"allowed is at most its draft_vocab_size={head.draft_vocab_size}"
            )
        target_hidden, target_vocab = target_sizes(target)
        if head.vocab_size != target_vocab:
            raise ValueError(
                f"eagle3 head vocab_size={head.vocab_size} does not match the target's vocab_size={target_vocab}: "
                "allowed is a head trained for this target"
            )
        config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        self.hidden_layers = eagle3_hidden_layers(int(config.num_hidden_layers), head.aux_layer_ids)
        if len(self.hidden_layers) * target_hidden != head.feature_size:
            raise ValueError(
                f"eagle3 head fc input width {head.feature_size} is invalid for this target: "
                f"allowed is {len(self.hidden_layers)} x hidden_size {target_hidden}"
            )
        self.settings = settings
        self.head = head
        self.head_name = head_name
        self.vocab_size = target_vocab
        self.device = input_device(target)
        self.pending: torch.Tensor | None = None  # features not yet fed, for positions cache_length ...
        self.root: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (context length, logits, hidden)

    def facts(self) -> dict[str, object]:
        return {
            "head": self.head_name,
            "hidden_layers": list(self.hidden_layers),
            "draft_vocab_size": self.head.draft_vocab_size,
            "device": str(self.head.fc.weight.device),
        }

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in begin: allowed is an engine that passes them")
        if features.shape[0] != prompt_ids.shape[0]:
            raise ValueError(f"features has {features.shape[0]} rows: allowed is one per prompt token ({prompt_ids.shape[0]})")
        self.head.reset()
        self.pending = features
        self.root = None

    def accept(self, path: list[int], features: torch.Tensor | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in accept: allowed is an engine that passes them")
        if features.shape[0] != len(path) + 1:
            raise ValueError(f"features has {features.shape[0]} rows: allowed is len(path) + 1 = {len(path) + 1}")
        features = features.to(self.pending.device if self.pending is not None else features.device)
        self.pending = features if self.pending is None or self.pending.shape[0] == 0 else torch.cat([self.pending, features])

    def root_outputs(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the committed pairs not yet cached; the head's (draft logits [draft_vocab],
        hidden [H]) after the last of the ``context`` tokens (CPU LongTensor[T])."""
        head, total = self.head, int(context.shape[0])
        start = head.cache_length
        waiting = 0 if self.pending is None else int(self.pending.shape[0])
        if waiting != total - 1 - start:
            raise ValueError(
                f"eagle3 holds features for positions up to {start + waiting - 1} but the context has {total} tokens: "
                f"allowed is one feature row per committed token but the newest (rows up to {total - 2})"
            )
        if waiting == 0:
            if self.root is None or self.root[0] != total:
                raise ValueError(f"eagle3 has no features for a context of {total} tokens: allowed is a context after begin")
            return self.root[1], self.root[2]
        tokens = context[start + 1 : total].to(head.fc.weight.device)
        positions = torch.arange(start, total - 1, device=head.fc.weight.device)
        logits, hidden = head(tokens, self.pending, positions)
        self.pending = self.pending[:0]
        self.root = (total, logits[-1], hidden[-1])
        return logits[-1], hidden[-1]

    def feed_frontier(self, frontier: Frontier, parent_hidden: torch.Tensor, committed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over the ``frontier`` nodes; their (draft logits [F, draft_vocab],
        hidden [F, H]). parent_hidden: [F, H], each node's parent's output hidden (the root's
        for depth 0). Each node attends to the ``committed`` pairs, its ancestors among the
        tree nodes fed before, and itself."""
        allowed, positions = frontier.attention(committed)
        device = self.head.fc.weight.device
        return self.head(frontier.tokens.to(device), parent_hidden, positions.to(device), allowed)

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        head = self.head
        root_logits, root_hidden = self.root_outputs(context)
        committed = head.cache_length
        previous = root_hidden[None]  # [F', H]: the head's output hidden of the last frontier fed

        def next_logprobs(frontier: Frontier) -> torch.Tensor:
            nonlocal previous
            logits, previous = self.feed_frontier(frontier, previous.index_select(0, frontier.parent_rows), committed)
            return head.target_logprobs(logits, self.vocab_size)

        root_logprobs = head.target_logprobs(root_logits[None], self.vocab_size)[0]
        shape = TreeShape.for_step(max_drafts, self.settings.top_k, self.settings.tree_tokens)
        tree = expand_tree(root_logprobs, next_logprobs, shape)
        head.truncate(committed)  # tree nodes leave the cache; committed pairs stay
        return tree.to_draft(self.device)


@register_drafter("eagle3", settings=Eagle3Settings, tree=True)
def eagle3_drafter(settings: Eagle3Settings, context: DrafterContext) -> Eagle3Drafter:
    """context.head: a folder or Hub id of a published EAGLE-3 head, or an ``Eagle3Head``."""
    head = context.head
    if head is None:
        raise ValueError(
            "drafter 'eagle3' got head=None: allowed is an EAGLE-3 head folder or Hub id (model.eagle3_head), or an Eagle3Head"
        )
    if context.target is None:
        raise ValueError("drafter 'eagle3' needs target=the target model: allowed is a drafter built for a target")
    if isinstance(head, Eagle3Head):
        return Eagle3Drafter(context.target, head, settings)
    return Eagle3Drafter(context.target, load_eagle3_head(head, context.target), settings, head_name=str(head))
