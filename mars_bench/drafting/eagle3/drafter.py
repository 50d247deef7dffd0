"""The ``eagle3`` drafter: an EAGLE-3 head grows an EAGLE-2 style dynamic tree per step.

How EAGLE drafts with the head, and the sources: ``docs/eagle3.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mars_bench.drafting.base import Draft, Drafter, DrafterContext, register_drafter
from mars_bench.drafting.tree import Frontiers, TreeSettings, expand_trees, step_shapes
from mars_bench.models.kvcache import block_layout, padded_rows
from mars_bench.models.placement import input_device
from mars_bench.verification.sampling import SamplingParams

if TYPE_CHECKING:
    from mars_bench.drafting.eagle3.head import Eagle3Head


@dataclass(frozen=True)
class Eagle3Settings(TreeSettings):
    """eagle3: EAGLE's --top-k 10 and --total-token 50, as the MARS paper runs it
    (conf/drafter/eagle3.yaml)."""

    top_k: int = 10
    tree_tokens: int = 50


class Eagle3Drafter(Drafter):
    """Drafts an EAGLE-2 style dynamic tree per row with an EAGLE-3 head, every row's tree grown together.

    The head keeps a cache row per sequence, holding one pair (feature_i, token_{i+1}) per committed token
    but the newest, at position i. Features arrive from the engine (``begin``: the prompts' rows;
    ``accept``: the root's and the accepted nodes' rows) and wait (``pending``) until the next ``propose``
    feeds them, every row's in one right-padded head forward whose last real slot per row is that row's root
    (a padded slot is masked for every later query). The trees then grow depth by depth (``expand_trees``),
    each depth one head forward over every row's frontier, each frontier attending to its row's pairs and
    its own ancestors, and their nodes leave the cache afterwards. Drafting is top-k (deterministic) at
    every temperature; ``probs`` is the head's softmax probability of each node's token given its parent.
    The host reads every row's tree in one transfer.

    head_name: the head's folder or Hub id, for the records (None for a head built in memory).
    """

    name = "eagle3"

    def __init__(self, target: Any, head: Eagle3Head, settings: Eagle3Settings | None = None, head_name: str | None = None):
        from mars_bench.drafting.eagle3.checkpoint import target_sizes
        from mars_bench.drafting.eagle3.head import eagle3_hidden_layers

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
        self.device = input_device(target)  # where the drafts go
        self.attended = torch.zeros(0, 0, dtype=torch.bool)  # [B, S]: the pairs each row sees
        self.cached: list[int] = []  # per row: pairs cached (the next pair's position)
        self.pending: list[torch.Tensor] = []  # per row: features not yet fed, [k_b, F]
        self.root: tuple[list[int], torch.Tensor, torch.Tensor] | None = None  # (context lengths, logits, hidden)

    @property
    def head_device(self) -> torch.device:
        return self.head.fc.weight.device

    def facts(self) -> dict[str, object]:
        return {
            "head": self.head_name,
            "hidden_layers": list(self.hidden_layers),
            "draft_vocab_size": self.head.draft_vocab_size,
            "device": str(self.head_device),
        }

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in begin: allowed is an engine that passes them")
        for prompt, rows in zip(prompts, features):
            if rows.shape[0] != prompt.shape[0]:
                raise ValueError(f"features has {rows.shape[0]} rows: allowed is one per prompt token ({prompt.shape[0]})")
        self.head.reset()
        self.attended = torch.zeros(len(prompts), 0, dtype=torch.bool, device=self.head_device)
        self.cached, self.pending, self.root = [0] * len(prompts), list(features), None

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in accept: allowed is an engine that passes them")
        for path, rows in zip(paths, features):
            if rows.shape[0] != len(path) + 1:
                raise ValueError(f"features has {rows.shape[0]} rows: allowed is len(path) + 1 = {len(path) + 1}")
        self.pending = [torch.cat([waiting, rows.to(waiting.device)]) for waiting, rows in zip(self.pending, features)]

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator | None]) -> list[Draft | None]:  # fmt: skip
        """Every drafting row's tree; the host reads them all in one transfer."""
        drafting = [limit > 0 for limit in limits]
        if not any(drafting):
            return [None] * len(contexts)
        root_logits, root_hidden = self.root_outputs(contexts)
        head, vocab, committed, context = self.head, self.vocab_size, self.attended.shape[1], self.attended
        shape, depths = step_shapes(limits, self.settings.top_k, self.settings.tree_tokens)
        previous = root_hidden[:, None]  # [B, F', H]: the head's output hidden of the last frontier fed

        def next_logprobs(frontiers: Frontiers) -> torch.Tensor:
            nonlocal previous
            parents = previous.gather(1, frontiers.parent_rows[:, :, None].expand(-1, -1, previous.shape[-1]))
            logits, previous = self.feed_frontiers(frontiers, parents, context)
            return head.target_logprobs(logits.flatten(0, 1), vocab).unflatten(0, logits.shape[:2])

        trees = expand_trees(head.target_logprobs(root_logits, vocab), next_logprobs, shape, depths)
        head.truncate(committed)  # tree nodes leave the cache; committed pairs stay
        return trees.to_drafts(self.device, drafting)

    def feed_frontiers(self, frontiers: Frontiers, parent_hidden: torch.Tensor,
                       context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One head forward over every row's frontier nodes: their (draft logits [B, F, draft_vocab], hidden
        [B, F, H]). parent_hidden: [B, F, H], each node's parent's output hidden (the root's at depth 0). Each
        node attends to its row's committed pairs (``context`` BoolTensor[B, S]), its ancestors among the tree
        nodes fed before, and itself."""
        allowed, positions = frontiers.attention(context)
        return self.head(frontiers.tokens, parent_hidden, positions, allowed)

    def root_outputs(self, contexts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's waiting pairs in one head forward; each row's (draft logits [B, draft_vocab], hidden
        [B, H]) after its last context token (the last ones again where no row has a pair waiting)."""
        lengths = [int(context.shape[0]) for context in contexts]
        if all(waiting.shape[0] == 0 for waiting in self.pending) and self.root is not None and self.root[0] == lengths:
            return self.root[1], self.root[2]
        for row, (length, start, waiting) in enumerate(zip(lengths, self.cached, self.pending)):
            if waiting.shape[0] == 0 or waiting.shape[0] != length - 1 - start:
                raise ValueError(
                    f"eagle3 holds {waiting.shape[0]} waiting feature rows for row {row}, whose context has {length} "
                    f"tokens and {start} pairs cached: allowed is one row per committed token but the newest, at least one"
                )
        tokens, fed = padded_rows([context[start + 1 :] for context, start in zip(contexts, self.cached)], left=False,
                                  device=self.head_device)  # fmt: skip
        features = torch.nn.utils.rnn.pad_sequence(self.pending, batch_first=True)
        block, depths = block_layout(fed)
        allowed = torch.cat([self.attended[:, None, :].expand(-1, tokens.shape[1], -1), block], dim=2)
        positions = self.attended.long().sum(dim=1, keepdim=True) + depths
        logits, hidden = self.head(tokens, features, positions, allowed)
        last = torch.tensor([waiting.shape[0] - 1 for waiting in self.pending], device=self.head_device)
        rows = torch.arange(len(contexts), device=self.head_device)
        self.attended = torch.cat([self.attended, fed], dim=1)
        self.cached = [start + waiting.shape[0] for start, waiting in zip(self.cached, self.pending)]
        self.pending = [waiting[:0] for waiting in self.pending]
        self.root = (lengths, logits[rows, last], hidden[rows, last])
        return self.root[1], self.root[2]

    def keep(self, rows: list[int]) -> None:
        selected = torch.tensor(rows, dtype=torch.long, device=self.head_device)
        self.head.keep_rows(selected)
        self.attended = self.attended.index_select(0, selected)
        self.cached = [self.cached[row] for row in rows]
        self.pending = [self.pending[row] for row in rows]
        self.root = None


@register_drafter("eagle3", settings=Eagle3Settings, tree=True)
def eagle3_drafter(settings: Eagle3Settings, context: DrafterContext) -> Eagle3Drafter:
    """context.head: a folder or Hub id of a published EAGLE-3 head, or an ``Eagle3Head``."""
    from mars_bench.drafting.eagle3.checkpoint import load_eagle3_head
    from mars_bench.drafting.eagle3.head import Eagle3Head

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
