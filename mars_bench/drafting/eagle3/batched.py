"""``eagle3`` over a batch of B rows: one head cache with a row per sequence, every row's tree grown together,
one batched head forward per depth, each row with its own tree, mask and target features.

Each row's tree is the one it grows alone (``Eagle3Drafter``), up to the numerics of batched forwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mars_bench.common.trees import additive_mask
from mars_bench.drafting.base import BatchDrafts, Draft
from mars_bench.drafting.batched_trees import step_shapes
from mars_bench.drafting.eagle3.drafter import Eagle3Drafter
from mars_bench.drafting.tree import Frontiers, expand_trees
from mars_bench.models.kvcache import block_layout, padded_rows
from mars_bench.verification.sampling import SamplingParams


class BatchedEagle3Drafts(BatchDrafts):
    """``eagle3`` drafting B rows at once with the one-sequence drafter's head and settings.

    As alone, row b's cache holds one pair (feature_i, token_{i+1}) per committed token but the newest, at
    position i; the features wait (``pending``) until the next ``propose`` feeds them, every row's in one
    right-padded head forward, whose last real slot per row is that row's root. A padded slot is masked
    for every later query; the trees' nodes leave the cache after each step.
    """

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter, self.head = drafter, drafter.head
        self.hidden_layers = drafter.hidden_layers
        self.device, self.dtype = drafter.head.fc.weight.device, drafter.head.fc.weight.dtype
        self.attended = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, S]: the pairs each row sees
        self.cached: list[int] = []  # per row: pairs cached (the next pair's position)
        self.pending: list[torch.Tensor] = []  # per row: features not yet fed, [k_b, F]

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in begin: allowed is an engine that passes them")
        for prompt, rows in zip(prompts, features):
            if rows.shape[0] != prompt.shape[0]:
                raise ValueError(f"features has {rows.shape[0]} rows: allowed is one per prompt token ({prompt.shape[0]})")
        self.head.reset()
        self.attended = torch.zeros(len(prompts), 0, dtype=torch.bool, device=self.device)
        self.cached, self.pending = [0] * len(prompts), list(features)

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in accept: allowed is an engine that passes them")
        self.pending = [torch.cat([waiting, rows.to(waiting.device)]) for waiting, rows in zip(self.pending, features)]

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator]) -> list[Draft | None]:  # fmt: skip
        """Every drafting row's tree; the host reads them all in one transfer."""
        drafting = [limit > 0 for limit in limits]
        if not any(drafting):
            return [None] * len(contexts)
        root_logits, root_hidden = self.feed(contexts)
        head, vocab, committed = self.head, self.drafter.vocab_size, self.attended.shape[1]
        settings = self.drafter.settings
        shape, depths = step_shapes(limits, settings.top_k, settings.tree_tokens)
        previous = root_hidden[:, None]  # [B, F', H]: the head's output hidden of the last frontier fed

        def next_logprobs(frontiers: Frontiers) -> torch.Tensor:
            nonlocal previous
            allowed, positions = frontiers.attention(self.attended)
            parents = previous.gather(1, frontiers.parent_rows[:, :, None].expand(-1, -1, previous.shape[-1]))
            logits, previous = head(frontiers.tokens, parents, positions, additive_mask(allowed, self.dtype, self.device))
            return head.target_logprobs(logits.flatten(0, 1), vocab).unflatten(0, logits.shape[:2])

        trees = expand_trees(head.target_logprobs(root_logits, vocab), next_logprobs, shape, depths)
        head.truncate(committed)  # tree nodes leave the cache; committed pairs stay
        return trees.to_drafts(self.drafter.device, drafting)

    def feed(self, contexts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's waiting pairs in one head forward; each row's (draft logits [B, draft_vocab], hidden [B, H])
        after its last context token."""
        for row, (context, start, waiting) in enumerate(zip(contexts, self.cached, self.pending)):
            if waiting.shape[0] == 0 or waiting.shape[0] != context.shape[0] - 1 - start:
                raise ValueError(
                    f"eagle3 holds {waiting.shape[0]} waiting feature rows for row {row}, whose context has "
                    f"{context.shape[0]} tokens and {start} pairs cached: allowed is one row per committed token but the "
                    "newest, at least one"
                )
        tokens, fed = padded_rows([context[start + 1 :] for context, start in zip(contexts, self.cached)], left=False,
                                  device=self.device)  # fmt: skip
        features = torch.nn.utils.rnn.pad_sequence(self.pending, batch_first=True)
        block, depths = block_layout(fed)
        allowed = torch.cat([self.attended[:, None, :].expand(-1, tokens.shape[1], -1), block], dim=2)
        positions = self.attended.long().sum(dim=1, keepdim=True) + depths
        logits, hidden = self.head(tokens, features, positions, additive_mask(allowed, self.dtype, self.device))
        last = torch.tensor([waiting.shape[0] - 1 for waiting in self.pending], device=self.device)
        rows = torch.arange(len(contexts), device=self.device)
        self.attended = torch.cat([self.attended, fed], dim=1)
        self.cached = [start + waiting.shape[0] for start, waiting in zip(self.cached, self.pending)]
        self.pending = [waiting[:0] for waiting in self.pending]
        return logits[rows, last], hidden[rows, last]

    def keep(self, rows: list[int]) -> None:
        selected = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.head.keep_rows(selected)
        self.attended = self.attended.index_select(0, selected)
        self.cached = [self.cached[row] for row in rows]
        self.pending = [self.pending[row] for row in rows]
