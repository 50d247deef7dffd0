"""``model_tree`` over a batch of B rows: every row's top-k tree grown together, one batched draft-model
forward per depth, each row with its own tree and its own mask (``drafting/tree.py``'s ``expand_trees``).

Each row's tree is the one it grows alone (``TreeModelDrafter``), up to the numerics of batched forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mars_bench.drafting.base import BatchDrafts, Draft
from mars_bench.drafting.tree import Frontiers, TreeShape, expand_trees
from mars_bench.models.kvcache import (
    batch_forward,
    check_tree_attention,
    crop_batch,
    masked_forward,
    new_cache,
    padded_rows,
    prefill_rows,
    select_batch_rows,
)
from mars_bench.verification.sampling import SamplingParams


def step_shapes(limits: Sequence[int], top_k: int, tree_tokens: int) -> tuple[TreeShape, list[int]]:
    """The shape every row's tree grows to in this step (the deepest row's) and each row's own depth
    (``TreeShape.for_step``; 1 for a row with no drafts to make, whose tree is dropped)."""
    depths = [TreeShape.for_step(max(limit, 1), top_k, tree_tokens).depth for limit in limits]
    return TreeShape(max(depths), top_k, tree_tokens), depths


class BatchedTreeModelDrafts(BatchDrafts):
    """``model_tree`` drafting B rows at once with the one-sequence drafter's model, vocabulary fit and tree
    settings (``TreeModelDrafter``).

    As alone, a row's cache holds its committed context (left-padded at ``begin``); each step feeds the
    tokens committed since, right-padded, then grows the trees depth by depth, each frontier attending
    to its row's context and its own ancestors, and drops the trees' nodes from the cache after.
    """

    def __init__(self, drafter: Any) -> None:
        self.drafter, self.model, self.device = drafter, drafter.model, drafter.device
        check_tree_attention(self.model)
        self.cache = new_cache(self.model)
        self.attended = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, S]: the positions each row sees
        self.valid: list[int] = []  # per row: context tokens cached

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        """Every prompt but its last token, left-padded, in one forward (the last is fed with the first step)."""
        self.valid, self.attended = prefill_rows(self.model, self.cache, prompts, self.device)

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator]) -> list[Draft | None]:  # fmt: skip
        """Every drafting row's tree; the host reads them all in one transfer."""
        drafting = [limit > 0 for limit in limits]
        if not any(drafting):
            return [None] * len(contexts)
        root = self.feed(contexts, drafting)
        committed = self.attended.shape[1]
        settings = self.drafter.settings
        shape, depths = step_shapes(limits, settings.top_k, settings.tree_tokens)

        def next_logprobs(frontiers: Frontiers) -> torch.Tensor:
            allowed, positions = frontiers.attention(self.attended)
            logits, _ = masked_forward(self.model, self.cache, frontiers.tokens, allowed, positions)
            return self.logprobs(logits.flatten(0, 1), sampling).unflatten(0, logits.shape[:2])

        trees = expand_trees(self.logprobs(root, sampling), next_logprobs, shape, depths)
        self.attended = crop_batch(self.cache, self.attended, committed)  # the trees' nodes leave the cache
        return trees.to_drafts(self.device, drafting)

    def logprobs(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Log q [R, V] of drafter logits [R, V'], as the one-sequence drafter scores its tree."""
        return torch.log(self.drafter.draft_probs(logits, sampling)[1])

    def feed(self, contexts: Sequence[torch.Tensor], drafting: Sequence[bool]) -> torch.Tensor:
        """Each drafting row's context tokens not cached yet, right-padded, in one forward: the drafter's
        logits after each row's context, [B, V'] (a row not drafting is not fed; its row is unused)."""
        feeds = [context[valid:] if draft else context[:0] for context, valid, draft in zip(contexts, self.valid, drafting)]
        tokens, fed = padded_rows(feeds, left=False, device=self.device)
        logits, self.attended = batch_forward(self.model, self.cache, self.attended, tokens, fed)
        self.valid = [len(context) if draft else valid for context, valid, draft in zip(contexts, self.valid, drafting)]
        last = torch.tensor([max(len(feed) - 1, 0) for feed in feeds], device=self.device)
        return logits[torch.arange(len(contexts), device=self.device), last]

    def keep(self, rows: list[int]) -> None:
        self.attended = select_batch_rows(self.cache, self.attended, rows)
        self.valid = [self.valid[row] for row in rows]
