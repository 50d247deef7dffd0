"""A separate small LM drafts a chain of tokens, or a top-k tree, keeping its own KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mars_bench.common.settings import OPTIONAL
from mars_bench.drafting.base import Draft, Drafter, DrafterContext, drafters_without_model, register_drafter
from mars_bench.drafting.draft_vocab import DraftVocabSettings, reduced_draft_model
from mars_bench.drafting.draft_weights import DraftWeightSettings, quantized_draft_model
from mars_bench.drafting.lookup import lookup_continuation
from mars_bench.drafting.stop import DraftStop
from mars_bench.drafting.tree import Frontier, TreeSettings, TreeShape, expand_tree
from mars_bench.models.kvcache import cached_forward, cached_logits, crop_to, new_cache
from mars_bench.models.placement import input_device
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits, sample_rows

GUESS_NGRAMS = (2, 3)  # the n-gram lengths (shortest, longest) whose earlier continuation the drafter's guesses copy


class ModelDrafter(Drafter):
    """Drafts autoregressively with ``model`` (any causal LM sharing the target's vocabulary).

    The cache holds the committed context plus the drafter's own unverified drafts; after a
    verdict it is cropped back to the tokens that were kept, so no token is fed twice.
    ``vocab_size``: the target's logits width; drafter distributions are padded or cut to it.
    ``stop``: the rule that may end a draft before ``max_drafts`` (``drafting/stop.py``; None:
    always draft ``max_drafts``), fresh for each sequence. Costs one host sync per drafted token.
    """

    name = "model"

    def __init__(self, model: Any, vocab_size: int | None = None, stop: DraftStop | None = None, settings: Any = None) -> None:
        self.settings = settings if settings is not None else ModelSettings()
        self.model = model
        self.vocab_size = vocab_size
        self.stop_rule = stop
        self.stop = stop.fresh() if stop is not None else None  # this sequence's (learns from its verdicts)
        self.draft_q: list[float] = []  # the last proposal's q, for the stop rule's verdict
        self.cache: Any = None  # its KV cache (models/kvcache.py), made per sequence
        self.cached_valid = 0  # leading cache positions that hold committed tokens
        self.cached_total = 0
        self.last_context_len = 0
        self.last_drafted = 0

    @property
    def device(self) -> torch.device:
        return input_device(self.model)

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.stop = self.stop_rule.fresh() if self.stop_rule is not None else None
        self.draft_q = []
        self.cache = new_cache(self.model)
        self.cached_valid = self.cached_total = 0
        if prompt_ids.numel() > 1:  # the last prompt token is fed with the first draft step
            self._forward(prompt_ids[:-1].to(self.device))
        self.cached_valid = self.cached_total

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward_rows(tokens, 1)[0]

    def _fit_vocab(self, rows: torch.Tensor, fill: float) -> torch.Tensor:
        width = self.vocab_size or rows.shape[-1]
        if rows.shape[-1] == width:
            return rows
        if rows.shape[-1] > width:
            return rows[..., :width]
        return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]), value=fill)

    def draft_probs(self, logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(processed logits, q) for drafter logits [R, V'] (fitted to the target's width).
        Greedy drafts still report q under softmax(logits): a confidence for draft-length
        policies and the tree drafter's scores."""
        processed = process_logits(self._fit_vocab(logits, float("-inf")), sampling)
        return processed, torch.softmax(processed, dim=-1) if sampling.greedy else probabilities(processed, sampling)

    def _rewind(self) -> None:
        crop_to(self.cache, self.cached_valid)
        self.cached_total = self.cached_valid

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        self._rewind()
        self._score_context(context)
        feed = context[self.cached_valid :].to(self.device)
        guesses = getattr(self.settings, "guesses", 0)
        history = context.cpu().tolist() if guesses else []  # what prompt lookup searches: context, then drafts
        tokens, token_probs, dists = [], [], []
        self.draft_q = []
        while len(tokens) < max_drafts:
            guessed = self._guess(history, min(guesses, max_drafts - len(tokens) - 1))
            cached_before = self.cached_total + int(feed.shape[0])
            logits = self._forward_rows(torch.cat([feed, guessed.to(self.device)]), int(guessed.shape[0]) + 1)
            processed, probs = self.draft_probs(logits, sampling)
            stop, produced = False, 0
            for row in range(logits.shape[0]):
                token = (
                    torch.argmax(processed[row : row + 1], dim=-1)
                    if sampling.greedy
                    else sample_rows(probs[row : row + 1], generator)
                )
                tokens.append(token)
                token_probs.append(probs[row : row + 1].gather(-1, token[:, None])[:, 0])
                if not sampling.greedy:
                    dists.append(probs[row : row + 1])
                produced += 1
                if self.stop is not None:
                    self.draft_q.append(float(token_probs[-1]))
                stop = self.stop is not None and not self.stop.keep_drafting(self.draft_q)
                if stop or row == guessed.shape[0] or int(token) != int(guessed[row]):
                    break
            # The cache holds every guess fed; keep only the confirmed ones (the newest draft is not fed yet).
            self._crop(cached_before + produced - 1)
            if guesses:
                history += [int(token) for token in tokens[-produced:]]
            feed = tokens[-1]
            if stop:
                break
        self.last_context_len = int(context.shape[0])
        self.last_drafted = len(tokens)
        return Draft(
            tokens=torch.cat(tokens),
            probs=torch.cat(token_probs),
            dists=torch.cat(dists) if dists else None,
        )

    def _score_context(self, context: torch.Tensor) -> None:
        """With ``context_vocab``, the draft model scores the context's tokens too (``ReducedHeadModel``)."""
        if getattr(self.settings, "context_vocab", False):
            self.model.use_context_tokens(context)

    def _guess(self, history: list[int], count: int) -> torch.Tensor:
        """Up to ``count`` tokens guessed by prompt lookup over ``history`` (empty when count is 0)."""
        if count <= 0:
            return torch.empty(0, dtype=torch.long)
        return lookup_continuation(torch.tensor(history), count, *GUESS_NGRAMS)

    def _forward_rows(self, tokens: torch.Tensor, rows: int) -> torch.Tensor:
        """Logits [rows, V] for the last ``rows`` of ``tokens`` fed to the cache."""
        logits = cached_logits(self.model, tokens, self.cache, keep_last=rows)
        self.cached_total += int(tokens.shape[0])
        return logits

    def _crop(self, length: int) -> None:
        if length < self.cached_total:
            crop_to(self.cache, length)
            self.cached_total = length

    def accept(self, path: list[int], features: torch.Tensor | None = None) -> None:
        if self.stop is not None:
            self.stop.verdict(self.draft_q, len(path))
            self.draft_q = []
        # The last drafted token was never fed, so at most drafted - 1 drafts are cached.
        self.cached_valid = self.last_context_len + max(0, min(len(path), self.last_drafted - 1))


def check_guesses(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"drafter.guesses={value!r} is invalid: allowed is an integer >= 0 (0: no guesses)")


@dataclass(frozen=True)
class ModelSettings(DraftWeightSettings, DraftVocabSettings):
    """model: a chain of gamma drafts (the engine's gamma and draft-length policy), optionally
    scored over a reduced vocabulary, optionally with quantized weights (conf/drafter/model.yaml).

    guesses: up to this many tokens, copied by prompt lookup from what followed the context's
        last n-gram earlier, ride along with each of the drafter's forwards; every guess the
        drafter's own choice confirms is a further draft from that forward (0: one draft per
        forward). The drafts are the ones the drafter makes without guesses.
    """

    guesses: int = field(default=0, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_guesses(self.guesses)


@dataclass(frozen=True)
class ModelTreeSettings(DraftWeightSettings, DraftVocabSettings, TreeSettings):
    """model_tree: a top-k tree of depth gamma, optionally drafted over a reduced vocabulary,
    optionally with quantized weights (conf/drafter/model_tree.yaml)."""

    top_k: int = 3
    tree_tokens: int = 16


class TreeModelDrafter(ModelDrafter):
    """Drafts a top-k tree with ``model`` (SpecInfer-style; grown as EAGLE-2 grows its trees).

    Per step one forward feeds the newly committed tokens and gives the root's children;
    each further depth feeds the ``top_k`` best frontier nodes in one tree-masked forward,
    so a tree of depth d costs d drafter forwards, like a chain of d drafts. The tree's
    nodes are dropped from the cache after drafting: the accepted ones are fed again, with
    the next step's new tokens, in the next step's first forward. Drafts are the top-k of
    the drafter's processed distribution, deterministic in greedy and sampling mode (q is
    reported per node for the verifiers that use it).
    """

    name = "model_tree"

    def __init__(self, model: Any, vocab_size: int | None = None, settings: ModelTreeSettings | None = None) -> None:
        super().__init__(model, vocab_size, settings=settings or ModelTreeSettings())

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        shape = TreeShape.for_step(max_drafts, self.settings.top_k, self.settings.tree_tokens)
        self._rewind()
        self._score_context(context)
        _, root_probs = self.draft_probs(self._forward(context[self.cached_valid :].to(self.device))[None], sampling)
        self.cached_valid = self.cached_total  # the whole context is cached now

        def next_logprobs(frontier: Frontier) -> torch.Tensor:
            logits, _ = cached_forward(self.model, frontier.tokens, self.cache, attention=frontier.attention(self.cached_valid))
            return torch.log(self.draft_probs(logits, sampling)[1])

        tree = expand_tree(torch.log(root_probs[0]), next_logprobs, shape)
        self._rewind()
        return tree.to_draft(self.device)

    def accept(self, path: list[int], features: torch.Tensor | None = None) -> None:
        """Nothing to keep: the committed context is cached, the tree was dropped."""


def drafting_model(settings: ModelSettings | ModelTreeSettings, context: DrafterContext) -> Any:
    """The separate draft model as the settings run it: its head cut to the draft vocabulary,
    then its weights quantized (the loaded model itself when neither is set)."""
    width = context.vocab_size or context.model.config.vocab_size
    return quantized_draft_model(reduced_draft_model(context.model, settings, width, context.tokenizer), settings.weights)


@register_drafter("model", settings=ModelSettings, needs_draft_model=True, stops=True)
def model_drafter(settings: ModelSettings, context: DrafterContext) -> ModelDrafter:
    if context.model is None:
        raise ValueError(f"drafter 'model' needs a separate draft model: the drafters without one are {drafters_without_model()}")
    return ModelDrafter(drafting_model(settings, context), context.vocab_size, context.stop, settings)


@register_drafter("model_tree", settings=ModelTreeSettings, needs_draft_model=True, tree=True)
def model_tree_drafter(settings: ModelTreeSettings, context: DrafterContext) -> TreeModelDrafter:
    if context.model is None:
        raise ValueError("drafter 'model_tree' needs a separate draft model (model.draft_model)")
    return TreeModelDrafter(drafting_model(settings, context), context.vocab_size, settings)
