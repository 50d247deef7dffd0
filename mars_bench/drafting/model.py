"""A separate small LM drafts a chain of tokens, or a top-k tree, for every row of a batch at once, keeping
its own KV cache (one batch of one for one sequence)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mars_bench.common.settings import OPTIONAL
from mars_bench.drafting.base import Draft, Drafter, DrafterContext, drafters_without_model, register_drafter
from mars_bench.drafting.draft_vocab import DraftVocabSettings, reduced_draft_model
from mars_bench.drafting.draft_weights import DraftWeightSettings, quantized_draft_model
from mars_bench.drafting.lookup import lookup_continuation
from mars_bench.drafting.stop import DraftStop
from mars_bench.drafting.tree import Frontiers, TreeSettings, expand_trees, step_shapes
from mars_bench.models.kvcache import BatchCache, check_tree_attention, masked_forward, padded_rows
from mars_bench.models.placement import input_device
from mars_bench.verification.sampling import RandomStreams, SamplingParams, probabilities, process_logits

GUESS_NGRAMS = (2, 3)  # the n-gram lengths (shortest, longest) whose earlier continuation the drafter's guesses copy


@dataclass
class _ChainRow:
    """One row of ``ModelDrafter``'s batch: what its cache holds and, for the current step, its draft.

    valid: committed tokens cached (its context but what it must still feed). stop: its own stop rule (None:
    none), learning from its own verdicts. The step's draft: limit (its most drafts), drafting (whether it
    drafts on), tokens / probs / dists (one [1] / [1] / [1, V] device slice per draft), q (the drafts' q on
    the host, for its stop rule), history (the context then the drafts, on the host, for its guesses: None
    without guesses), context_length and columns (the cache positions its fed drafts went to).
    """

    valid: int
    stop: DraftStop | None
    limit: int = 0
    drafting: bool = False
    tokens: list[torch.Tensor] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    history: list[int] | None = None
    context_length: int = 0
    columns: list[int] = field(default_factory=list)

    def start(self, context: torch.Tensor, limit: int, guesses: bool) -> None:
        """A new step's draft after ``context`` (CPU LongTensor[T]), at most ``limit`` drafts."""
        self.limit, self.drafting, self.context_length = limit, limit > 0, len(context)
        self.tokens, self.probs, self.dists, self.q, self.columns = [], [], [], [], []
        self.history = context.tolist() if guesses and self.drafting else None

    def draft(self) -> Draft | None:
        if not self.tokens:
            return None
        dists = torch.cat(self.dists) if self.dists else None
        return Draft(tokens=torch.cat(self.tokens), probs=torch.cat(self.probs), dists=dists)


class ModelDrafter(Drafter):
    """Drafts chains autoregressively with ``model`` (any causal LM sharing the target's vocabulary), every
    row of the batch in the same batched forwards.

    A row's cache holds its committed context but the newest token, plus its fed drafts. A step feeds each
    row's tokens not cached yet (right-padded, one forward), then one token per row per further draft
    position; a row that has stopped drafting is fed a masked pad. After the verdict a row keeps its fed
    drafts up to its accepted count (its last draft is never fed); the others are masked for it
    (``BatchCache``), and the positions no row attends to are cropped. A batch of one masks nothing: it
    crops, and runs the plain cached forward.

    ``vocab_size``: the target's logits width; drafter distributions are padded or cut to it. ``stop``: the
    rule that may end a row's draft before its limit (``drafting/stop.py``; None: always draft the limit),
    fresh for each row. ``settings.guesses``: prompt-lookup guesses that ride along with each forward, per
    row (``ModelSettings``); ``settings.context_vocab``: each row's q also covers its own context's tokens
    (``ReducedHeadModel.use_context_tokens``).

    Host reads: none while drafting, but once per draft position under a stop rule (the stop is a host
    decision), with guesses once per drafter forward (greedy) or per draft position (sampling), since the
    next guesses and whether a guess was confirmed are host decisions, and with context tokens twice per step
    (which tokens the contexts add, and whether they changed): never once per row.
    """

    name = "model"

    def __init__(self, model: Any, vocab_size: int | None = None, stop: DraftStop | None = None, settings: Any = None) -> None:
        self.settings = settings if settings is not None else ModelSettings()
        self.model = model
        self.vocab_size = vocab_size
        self.stop_rule = stop
        self.cache: BatchCache | None = None  # the batch's cache (models/kvcache.py), made per batch
        self.rows: list[_ChainRow] = []
        self.committed_end = 0  # the cache's width once the last proposal fed every row's committed tokens
        self.awaiting_accept = False  # a proposal's drafts are in the cache until its accept

    @property
    def device(self) -> torch.device:
        return input_device(self.model)

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        """Every prompt but its last token, left-padded, in one forward (the last is fed with the first draft)."""
        self.awaiting_accept = False
        self.cache = BatchCache(self.model, len(prompts))
        self.rows = [_ChainRow(len(prompt) - 1, None if self.stop_rule is None else self.stop_rule.fresh()) for prompt in prompts]
        self._score_context(prompts)
        tokens, fed = padded_rows([prompt[:-1] for prompt in prompts], left=True, device=self.device)
        if tokens.shape[1]:  # else every prompt is one token: nothing to prefill
            self.cache.forward(tokens, fed, logits_to_keep=1)

    def _fit_vocab(self, rows: torch.Tensor, fill: float) -> torch.Tensor:
        width = self.vocab_size or rows.shape[-1]
        if rows.shape[-1] == width:
            return rows
        if rows.shape[-1] > width:
            return rows[..., :width]
        return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]), value=fill)

    def draft_probs(self, logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(processed logits, q) for drafter logits [..., V'] (fitted to the target's width).
        Greedy drafts still report q under softmax(logits): a confidence for draft-length
        policies and the tree drafter's scores."""
        processed = process_logits(self._fit_vocab(logits, float("-inf")), sampling)
        return processed, torch.softmax(processed, dim=-1) if sampling.greedy else probabilities(processed, sampling)

    def _score_context(self, contexts: Sequence[torch.Tensor]) -> None:
        """With ``context_vocab``, the draft model scores each row's context tokens too (``ReducedHeadModel``)."""
        if getattr(self.settings, "context_vocab", False):
            self.model.use_context_tokens(contexts)

    def feed(self, tokens: torch.Tensor, fed: torch.Tensor | None, fronts: Sequence[int], width: int) -> torch.Tensor:
        """One forward of ``tokens`` [B, n] (``fed``: the real slots, each row's a prefix; None: all) appended to the cache:
        row b's drafter logits after its slots ``fronts[b] - 1 .. fronts[b] - 2 + width``, [B, width, V'] (a row
        with front 0 is not fed; its logits are unused). Only the logits asked for are computed: at one row, the
        last ``width`` slots'."""
        fronts = list(fronts)
        first = min(front for front in fronts if front > 0)
        keep = tokens.shape[1] - first + 1
        logits = self.cache.forward(tokens, fed, logits_to_keep=keep)[0]
        if all(front in (0, first) for front in fronts):
            return logits[:, :width]
        index = torch.tensor([[max(front - first, 0) + slot for slot in range(width)] for front in fronts], device=logits.device)
        return logits.gather(1, index.clamp(max=keep - 1)[:, :, None].expand(-1, -1, logits.shape[-1]))

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator | None]) -> list[Draft | None]:  # fmt: skip
        """Every row's chain, on the device: per drafter forward, each row drafts one token and then, while its
        choice confirms the next of its guesses, one more from the same forward. Refused before the last
        proposal's ``accept``: its drafts are still in the cache, and the next chain would follow them."""
        if self.awaiting_accept:
            raise RuntimeError(f"{type(self).__name__}.propose was called again before accept: allowed is begin, "
                               "then propose and accept in turn")  # fmt: skip
        self.awaiting_accept = True
        guesses = getattr(self.settings, "guesses", 0)
        for row, context, limit in zip(self.rows, contexts, limits):
            row.start(context, limit, guesses > 0)
        self.committed_end = self.cache.length
        if not any(row.drafting for row in self.rows):
            return [None] * len(contexts)
        self._score_context(contexts)
        first = True
        while any(row.drafting for row in self.rows):
            guessed = [self._guess(row.history, min(guesses, row.limit - len(row.tokens) - 1)) if row.drafting else []
                       for row in self.rows]  # fmt: skip
            if first:
                pending = [len(context) - row.valid if row.drafting else 0 for row, context in zip(self.rows, contexts)]
                feeds = [torch.cat([context[row.valid :], torch.tensor(guess, dtype=torch.long)]) if row.drafting else []
                         for row, context, guess in zip(self.rows, contexts, guessed)]  # fmt: skip
                tokens, fed = padded_rows(feeds, left=False, device=self.device)
            else:
                pending = [1 if row.drafting else 0 for row in self.rows]
                tokens, fed = self._next_feed(guessed)
            start = self.cache.length
            logits = self.feed(tokens, fed, pending, 1 + max(len(guess) for guess in guessed))
            if first:
                self.committed_end = start + max(pending)
            active = [index for index, row in enumerate(self.rows) if row.drafting]
            made = self._choose(logits, sampling, generators, active, guessed)
            for row, count, front in zip(self.rows, made, pending):
                if count:  # the fed drafts: the last one fed before this forward and the confirmed guesses
                    row.columns += range(start + (front if first else 0), start + front + count - 1)
            if any(guessed):  # a row's unconfirmed guesses leave its cache (else it keeps every slot it was fed)
                self.cache.commit([range(front + count - 1) if count else range(0) for front, count in zip(pending, made)])
            first = False
        return [row.draft() for row in self.rows]

    def _next_feed(self, guessed: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next forward's input [B, 1 + G] after the first: each drafting row's newest draft (on the device, never
        read), then its guesses; a row that has stopped drafting is fed a masked pad. ``fed``: None where every slot
        is real."""
        drafting = [row.drafting for row in self.rows]
        if len(self.rows) == 1:
            newest = self.rows[0].tokens[-1]
        else:
            pad = torch.zeros(1, dtype=torch.long, device=self.device)
            newest = torch.cat([row.tokens[-1] if row.drafting else pad for row in self.rows])
        tokens, fed = newest[:, None], None if all(drafting) else torch.tensor(drafting, device=self.device)[:, None]
        if any(guessed):
            guess_tokens, guess_fed = padded_rows(guessed, left=False, device=self.device)
            fed = torch.cat([torch.ones_like(tokens, dtype=torch.bool) if fed is None else fed, guess_fed], dim=1)
            tokens = torch.cat([tokens, guess_tokens], dim=1)
        return tokens, fed

    def _choose(self, logits: torch.Tensor, sampling: SamplingParams, generators: Sequence[torch.Generator | None],
                active: list[int], guessed: list[list[int]]) -> list[int]:  # fmt: skip
        """Each active row's drafts from one forward's logits [B, W, V']: the token after its fed tokens, then, while
        the token it chose equals its next guess, the token after that guess (as it would draft it after a forward
        of its own). Greedy, argmax; sampling, a draw from the row's own stream, one per draft, so the drafts and the
        draws are those made without guesses. Returns the drafts each row made (0 for a row not active)."""
        processed, probs = self.draft_probs(logits.flatten(0, 1), sampling)
        processed, probs = processed.unflatten(0, logits.shape[:2]), probs.unflatten(0, logits.shape[:2])
        made = [0] * len(self.rows)
        host_wanted = self.stop_rule is not None or any(row.history is not None for row in self.rows)
        if sampling.greedy:
            chosen = torch.argmax(processed, dim=-1)  # [B, W]
            chosen_q = probs.gather(-1, chosen[:, :, None])[:, :, 0]
            read = torch.stack([chosen.double(), chosen_q.double()]).tolist() if host_wanted else None  # once per forward
        for position in range(logits.shape[1]):
            if not active:
                break
            if sampling.greedy:
                token, q = chosen[:, position], chosen_q[:, position]
                host = None if read is None else [[values[position] for values in rows] for rows in read]
            else:  # only the active rows draw, each from its own stream
                streams = RandomStreams(tuple(generators[index] for index in active), (1,) * len(active))
                if len(active) == len(self.rows):  # every row draws (always at B = 1)
                    token = streams.sample(probs[:, position], (1,) * len(active))
                else:
                    token = torch.argmax(processed[:, position], dim=-1)
                    drawing = torch.tensor(active, device=token.device)
                    drawn = streams.sample(probs[:, position].index_select(0, drawing), (1,) * len(active))
                    token = token.index_copy(0, drawing, drawn)
                q = probs[:, position].gather(-1, token[:, None])[:, 0]
                host = torch.stack([token.double(), q.double()]).tolist() if host_wanted else None  # once per position
            going = []
            for index in active:
                row = self.rows[index]
                row.tokens.append(token[index : index + 1])
                row.probs.append(q[index : index + 1])
                if not sampling.greedy:
                    row.dists.append(probs[index, position][None])
                made[index] += 1
                go_on = True
                if row.history is not None:
                    row.history.append(int(host[0][index]))
                if row.stop is not None:
                    row.q.append(host[1][index])
                    go_on = row.stop.keep_drafting(row.q)
                if not go_on or len(row.tokens) >= row.limit:
                    row.drafting = False
                elif position < len(guessed[index]) and int(host[0][index]) == guessed[index][position]:
                    going.append(index)  # its guess was confirmed: its next draft comes from this same forward
            active = going
        return made

    def _guess(self, history: list[int] | None, count: int) -> list[int]:
        """Up to ``count`` tokens guessed by prompt lookup over ``history`` (none when count is 0)."""
        if history is None or count <= 0:
            return []
        return lookup_continuation(torch.tensor(history), count, *GUESS_NGRAMS).tolist()

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        """Each row keeps its fed drafts up to its accepted count (its last draft was never fed); the rest are
        forgotten, and the positions past every row's kept ones are cropped."""
        self.awaiting_accept = False
        length = self.committed_end
        for row, path in zip(self.rows, paths):
            count = len(path)
            if row.stop is not None:
                row.stop.verdict(row.q, count)
                row.q = []
            if row.limit > 0:
                row.valid = row.context_length + min(count, len(row.columns))
            length = max([length] + [column + 1 for column in row.columns[:count]])
        self.cache.forget([row.columns[len(path) :] for row, path in zip(self.rows, paths)], length)
        for row in self.rows:
            row.columns = []

    def keep(self, rows: list[int]) -> None:
        self.cache.keep_rows(rows)
        self.rows = [self.rows[row] for row in rows]


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
    """Drafts a top-k tree per row with ``model`` (SpecInfer-style; grown as EAGLE-2 grows its trees), every
    row's tree grown together (``expand_trees``), each with its own mask.

    Per step one forward feeds each row's newly committed tokens (right-padded) and gives its root's children;
    each further depth feeds every row's ``top_k`` best frontier nodes in one tree-masked forward, each
    frontier attending to its row's context and its own ancestors, so a tree of depth d costs d drafter
    forwards, like a chain of d drafts. The trees' nodes are dropped from the cache after drafting: the
    accepted ones are fed again, with the next step's new tokens, in the next step's first forward. Drafts are
    the top-k of the drafter's processed distribution, deterministic in greedy and sampling mode (q is
    reported per node for the verifiers that use it); the host reads every row's tree in one transfer.
    """

    name = "model_tree"

    def __init__(self, model: Any, vocab_size: int | None = None, settings: ModelTreeSettings | None = None) -> None:
        super().__init__(model, vocab_size, settings=settings or ModelTreeSettings())

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        check_tree_attention(self.model)  # its frontiers attend through a tree mask
        super().begin(prompts, features)

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator | None]) -> list[Draft | None]:  # fmt: skip
        drafting = [limit > 0 for limit in limits]
        if not any(drafting):
            return [None] * len(contexts)
        self._score_context(contexts)
        feeds = [context[row.valid :] if draft else context[:0] for row, context, draft in zip(self.rows, contexts, drafting)]
        tokens, fed = padded_rows(feeds, left=False, device=self.device)
        root = self.feed(tokens, fed, [len(feed) for feed in feeds], 1)[:, 0]
        for row, context, draft in zip(self.rows, contexts, drafting):
            row.valid = len(context) if draft else row.valid  # the whole context is cached now
        committed, context = self.cache.length, self.cache.attending  # [B, committed]: what each row's context is
        shape, depths = step_shapes(limits, self.settings.top_k, self.settings.tree_tokens)

        def next_logprobs(frontiers: Frontiers) -> torch.Tensor:
            allowed, positions = frontiers.attention(context)
            logits, _ = masked_forward(self.model, self.cache.cache, frontiers.tokens, allowed, positions)
            return self.logprobs(logits.flatten(0, 1), sampling).unflatten(0, logits.shape[:2])

        trees = expand_trees(self.logprobs(root, sampling), next_logprobs, shape, depths)
        self.cache.crop(committed)  # the trees' nodes leave the cache
        return trees.to_drafts(self.device, drafting)

    def logprobs(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Log q [R, V] of drafter logits [R, V']."""
        return torch.log(self.draft_probs(logits, sampling)[1])

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        """Nothing to keep: the committed context is cached, the trees were dropped."""


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
