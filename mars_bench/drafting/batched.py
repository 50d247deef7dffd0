"""Every drafter in the form the engine drafts B rows with (``BatchDrafts``): the same drafts each row gets alone.

``drafts_for(drafter, rows)`` picks it. One row runs the drafter's own one-sequence code
(``SequenceDrafts``), so every drafter and every setting it has works there. Several rows run the
batched form (``batch_drafter``): ``lookup`` proposes per row (it keeps no state and costs no forward);
``model`` and ``layerskip`` (a ``ModelDrafter`` over the target's first layers) draft every row with one
batched draft-model forward per draft position (``BatchedModelDrafts``); ``model_tree`` and ``eagle3``
grow every row's tree together, one batched forward per depth (``batched_trees.py``, ``eagle3/batched.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mars_bench.drafting.base import BatchDrafts, Draft, Drafter
from mars_bench.drafting.batched_trees import BatchedTreeModelDrafts
from mars_bench.drafting.eagle3.batched import BatchedEagle3Drafts
from mars_bench.models.kvcache import batch_forward, crop_batch, new_cache, padded_rows, prefill_rows, select_batch_rows
from mars_bench.verification.sampling import RandomStreams, SamplingParams

BATCHED_DRAFTERS = ("lookup", "model", "layerskip", "model_tree", "eagle3")  # the engine batches these, besides none
MODEL_DRAFTERS = ("model", "layerskip")  # drafted by BatchedModelDrafts
# The model drafter's settings that ride on one sequence's drafter: each one's value when off, and why batches
# refuse it (so does the app, before loading: ``config.check_batch_settings``).
ONE_SEQUENCE_SETTINGS = {"guesses": (0, "rides on one sequence's drafter forwards"),
                         "context_vocab": (False, "scores one sequence's own tokens")}  # fmt: skip


def check_batch_drafter(drafter: Drafter | str | None, allowed: Sequence[str] = BATCHED_DRAFTERS) -> None:
    """ValueError, in one line, for a drafter (or a drafter's registered name) not among ``allowed`` at batch_size > 1:
    one registered by a user, which drafts one sequence only."""
    name = drafter if isinstance(drafter, str) or drafter is None else drafter.name
    if name not in (None, "none", *allowed):
        raise ValueError(f"drafter={name!r} is not batched yet (batch_size > 1): allowed are {', '.join(('none', *allowed))}")


class SequenceDrafts(BatchDrafts):
    """One row, drafted by the drafter's own one-sequence code (``Drafter``; None: no drafts), as ``decode``
    has always drafted: any drafter, with every setting it has (guesses, context tokens, trees, features)."""

    def __init__(self, drafter: Drafter | None) -> None:
        self.drafter = drafter
        self.hidden_layers = drafter.hidden_layers if drafter is not None else ()

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        if self.drafter is not None:
            self.drafter.begin(prompts[0], None if features is None else features[0])

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator]) -> list[Draft | None]:  # fmt: skip
        if self.drafter is None or limits[0] <= 0:
            return [None]
        return [self.drafter.propose(contexts[0], limits[0], sampling, generators[0])]

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        if self.drafter is not None:
            self.drafter.accept(paths[0], None if features is None else features[0])


class RowDrafts(BatchDrafts):
    """A drafter with no per-sequence state, asked row by row (``lookup``; none: no drafts)."""

    def __init__(self, drafter: Drafter | None) -> None:
        self.drafter = drafter

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator]) -> list[Draft | None]:  # fmt: skip
        if self.drafter is None:
            return [None] * len(contexts)
        draws = zip(contexts, limits, generators)
        return [self.drafter.propose(context, limit, sampling, stream) if limit > 0 else None for context, limit, stream in draws]


class BatchedModelDrafts(BatchDrafts):
    """``model`` or ``layerskip`` drafting B rows at once, with the one-sequence drafter's model, vocabulary fit and
    stop rule (``ModelDrafter``; each row its own, fresh per prompt): each row's drafts are those it drafts
    alone, up to the numerics of a batched matmul.

    As alone, a row's cache holds its committed tokens but the newest, plus its fed drafts; a
    draft position its verdict rejects is masked for that row (the engine's scheme, ``BatchCache``), and the
    positions no row attends to are cropped. A step feeds each row's new tokens in one forward, then
    one token per row per further draft position; a row that has stopped drafting is fed a masked pad.
    """

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        self.model = drafter.model
        self.device = drafter.device
        self.cache = new_cache(self.model)
        self.attended = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.valid: list[int] = []  # per row: committed tokens cached (its context less what must be fed)
        self.context_lengths: list[int] = []  # per row: its context's length at the last proposal
        self.draft_columns: list[list[int]] = []  # per row: the cache columns its fed drafts went to
        self.fed: list[bool] = []  # per row: whether the last proposal fed it (it had drafts to make)
        self.stops: list[Any] = []  # per row: its stop rule (None: none), learning from its own verdicts
        self.draft_q: list[list[float]] = []  # per row: the last proposal's q, for its stop rule's verdict
        self.feed_end = 0  # the cache's width after the last proposal's first forward

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        """Every prompt but its last token, left-padded, in one forward (the last is fed with the first draft)."""
        self.valid, self.attended = prefill_rows(self.model, self.cache, prompts, self.device)
        self.context_lengths, self.fed, self.draft_columns = list(self.valid), [False] * len(prompts), [[] for _ in prompts]
        rule = self.drafter.stop_rule
        self.stops = [None if rule is None else rule.fresh() for _ in prompts]
        self.draft_q = [[] for _ in prompts]

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator]) -> list[Draft | None]:  # fmt: skip
        """Every row's drafts, on the device. Under a stop rule the host reads every row's q once per
        draft position (the stop is a host decision); else it reads nothing: the engine learns the kept
        tokens with the verdicts. Never once per row, so a step's host syncs do not grow with B."""
        rows = len(contexts)
        logits = self.feed(contexts, limits)
        drafting = list(self.fed)
        tokens_per_row: list[list[torch.Tensor]] = [[] for _ in contexts]
        probs_per_row: list[list[torch.Tensor]] = [[] for _ in contexts]
        dists_per_row: list[list[torch.Tensor]] = [[] for _ in contexts]
        for depth in range(max(limits, default=0)):
            processed, probs = self.drafter.draft_probs(logits, sampling)
            token = torch.argmax(processed, dim=-1)
            if not sampling.greedy:  # only the rows still drafting draw, each from its own stream, as alone
                active = [index for index in range(rows) if drafting[index]]
                streams = RandomStreams(tuple(generators[index] for index in active), (1,) * len(active))
                chosen = torch.tensor(active, device=self.device)
                token = token.index_copy(0, chosen, streams.sample(probs.index_select(0, chosen), (1,) * len(active)))
            q = probs.gather(-1, token[:, None])[:, 0]
            host_q = q.tolist() if self.drafter.stop_rule is not None else []  # one host read per position
            for index in range(rows):
                if drafting[index]:
                    tokens_per_row[index].append(token[index : index + 1])
                    probs_per_row[index].append(q[index : index + 1])
                    if not sampling.greedy:
                        dists_per_row[index].append(probs[index : index + 1])
                    go_on = True
                    if self.stops[index] is not None:
                        self.draft_q[index].append(host_q[index])
                        go_on = self.stops[index].keep_drafting(self.draft_q[index])
                    drafting[index] = depth + 1 < limits[index] and go_on
            if not any(drafting):
                break
            column = self.attended.shape[1]
            for index in range(rows):
                if drafting[index]:
                    self.draft_columns[index].append(column)
            fed = torch.tensor(drafting, device=self.device)[:, None]
            logits, self.attended = batch_forward(self.model, self.cache, self.attended, token[:, None], fed)
            logits = logits[:, -1]
        return [
            Draft(tokens=torch.cat(row_tokens), probs=torch.cat(row_probs), dists=torch.cat(row_dists) if row_dists else None)
            if row_tokens
            else None
            for row_tokens, row_probs, row_dists in zip(tokens_per_row, probs_per_row, dists_per_row)
        ]

    def feed(self, contexts: Sequence[torch.Tensor], limits: Sequence[int]) -> torch.Tensor | None:
        """Each drafting row's tokens not cached yet, right-padded, in one forward: its next-token logits [B, V']
        (None, with no forward, where no row drafts)."""
        self.fed = [limit > 0 for limit in limits]
        self.context_lengths = [len(context) for context in contexts]
        self.draft_columns = [[] for _ in contexts]
        self.draft_q = [[] for _ in contexts]
        self.feed_end = self.attended.shape[1]
        if not any(self.fed):
            return None
        feeds = [context[valid:] for context, valid in zip(contexts, self.valid)]
        tokens, fed = padded_rows(feeds, left=False, device=self.device)
        fed &= torch.tensor(self.fed, device=self.device)[:, None]  # a row with no drafts to make is not fed
        logits, self.attended = batch_forward(self.model, self.cache, self.attended, tokens, fed)
        self.feed_end = self.attended.shape[1]
        last = torch.tensor([max(len(feed) - 1, 0) for feed in feeds], device=self.device)
        return logits[torch.arange(len(contexts), device=self.device), last]

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        """Each row keeps its fed drafts up to its accepted count (its last draft was never fed), as alone;
        the columns past the fed context and every row's kept drafts are cropped."""
        forget = torch.zeros_like(self.attended)
        needed = self.feed_end
        for index, (path, columns) in enumerate(zip(paths, self.draft_columns)):
            count = len(path)
            if self.stops[index] is not None:
                self.stops[index].verdict(self.draft_q[index], count)
                self.draft_q[index] = []
            if self.fed[index]:
                self.valid[index] = self.context_lengths[index] + min(count, len(columns))
            forget[index, columns[count:]] = True
            needed = max([needed] + [column + 1 for column in columns[:count]])
        self.attended = crop_batch(self.cache, self.attended & ~forget, needed)

    def keep(self, rows: list[int]) -> None:
        self.attended = select_batch_rows(self.cache, self.attended, rows)
        self.valid = [self.valid[row] for row in rows]
        self.context_lengths = [self.context_lengths[row] for row in rows]
        self.draft_columns = [self.draft_columns[row] for row in rows]
        self.fed = [self.fed[row] for row in rows]
        self.stops = [self.stops[row] for row in rows]
        self.draft_q = [self.draft_q[row] for row in rows]


def cli_value(value: object) -> str:
    """A setting's value as a command line writes it (true/false for booleans, null for None)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def one_sequence_setting(settings: object) -> tuple[str, object, object, str] | None:
    """The first of ``ONE_SEQUENCE_SETTINGS`` that ``settings`` (a drafter's settings, or a mapping) sets on:
    (key, its value, its value when off, why a batch refuses it); None where every one is off or absent."""
    for key, (off, reason) in ONE_SEQUENCE_SETTINGS.items():
        value = settings.get(key, off) if isinstance(settings, dict) else getattr(settings, key, off)
        if value != off:
            return key, value, off, reason
    return None


def batch_drafter(drafter: Drafter | None) -> BatchDrafts:
    """The batched form of ``drafter`` for B > 1 rows (None: the AR baseline's: no drafts); ValueError, in one
    line, for a drafter the engine does not batch or a setting that rides on one sequence."""
    check_batch_drafter(drafter, BATCHED_DRAFTERS)
    if (found := one_sequence_setting(getattr(drafter, "settings", None))) is not None:
        key, value, off, reason = found
        raise ValueError(f"drafter.{key}={cli_value(value)} {reason}: allowed at batch_size > 1 is {cli_value(off)}")
    name = None if drafter is None else drafter.name
    if name in MODEL_DRAFTERS:
        return BatchedModelDrafts(drafter)
    if name == "model_tree":
        return BatchedTreeModelDrafts(drafter)
    if name == "eagle3":
        return BatchedEagle3Drafts(drafter)
    return RowDrafts(drafter)


def drafts_for(drafter: Drafter | None, rows: int) -> BatchDrafts:
    """How the engine drafts ``rows`` rows with ``drafter``: one row with the drafter's own code, more batched."""
    return SequenceDrafts(drafter) if rows == 1 else batch_drafter(drafter)
