"""The decoding engine: B prompts decoded together, one request being a batch of one.

Prefill, then per step: draft -> one target forward for every row -> verify -> commit. The
autoregressive baseline is the same loop with no drafter: same model object, same cache, same
token choice, same stop handling. Each row keeps its own prompt length, drafts (a chain or its own
tree), verdict, random streams, draft-length policy and stop; a finished row leaves the batch, which
shrinks (no refill: that is a serving engine's job). One ``verify_batch`` call judges every row, each
drawing from its own stream, seeded as ``decode`` seeds one prompt, so a row decodes as it would alone
up to the numerics of a batched matmul.

The target's cache is one ``BatchCache`` (``models/kvcache.py``): a row keeps its root and accepted
drafts (a tree's path is gathered to the front of its block), the rest of its slots are masked, and
the positions past every row's kept ones are cropped. A batch of one has nothing to mask: it runs the
plain cached forward, causal for a chain and tree-masked for a tree. The drafter drafts every row through
one contract at any B (``Drafter`` in ``drafting/base.py``). Every phase is timed by one ``Clock``
(``decoding/clock.py``: CUDA events on a GPU, at any B).

A step reads the device once, whatever B is: the verdicts of every row in one transfer, with each
row's kept draft tokens (``Verdict.path_tokens``), or the rows' next tokens when no row drafted. A tree
drafter reads its trees once more, all rows in one transfer. The model drafter's host decisions read more,
every row's at once, never once per row: a stop rule (``confidence``, ``gain``) every row's draft probability
once per draft position, lookup guesses every row's drafts once per drafter forward (greedy) or per draft
position (sampling), context tokens which tokens the rows' contexts add, twice per step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mars_bench.common.trees import is_chain, node_depths
from mars_bench.decoding.clock import Clock
from mars_bench.decoding.draft_length import DEFAULT_LENGTH, DraftLength, FixedLength
from mars_bench.decoding.fidelity import PositionCosts, step_costs
from mars_bench.decoding.trace import DecodeResult, StepRecord
from mars_bench.drafting.base import Draft, Drafter
from mars_bench.models.kvcache import BatchCache, check_tree_attention, padded_rows
from mars_bench.models.placement import input_device
from mars_bench.verification import Verdict, Verifier, VerifyInput, batch_steps, get_verifier
from mars_bench.verification.base import statistic_lists
from mars_bench.verification.sampling import SamplingParams, choose_tokens

StopWhen = Callable[[list[int]], bool]


@dataclass(frozen=True)
class DecodeSettings:
    """Per-sequence limits. gamma: drafted tokens per step (chain length)."""

    max_new_tokens: int = 128
    gamma: int = DEFAULT_LENGTH.gamma
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for option, value, low in (("max_new_tokens", self.max_new_tokens, 1), ("gamma", self.gamma, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{option}={value!r} is invalid: allowed is an integer >= {low}")


def chain_parents(count: int) -> torch.Tensor:
    return torch.arange(-1, count - 1)


def block_parents(draft_parents: torch.Tensor) -> torch.Tensor:
    """Parents within the verified block [root, node 0, ...]: the root follows the cached
    prefix (-1), node i sits at block index i + 1 and a root child's parent is the root."""
    return torch.cat([torch.tensor([-1]), draft_parents.cpu() + 1])


def cut_at_stop(tokens: list[int], stop_ids: Iterable[int], budget: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first stop token, and at most ``budget``."""
    stops = set(stop_ids)
    for index, token in enumerate(tokens[:budget]):
        if token in stops:
            return tokens[: index + 1], True
    return tokens[:budget], False


def resolve_verifier(drafter: Drafter | None, verifier: Verifier | str | None) -> Verifier | None:
    """The verifier a decode judges ``drafter``'s drafts with: built from its registered name if given
    one; a ValueError where there is a drafter and no verifier."""
    if isinstance(verifier, str):
        verifier = get_verifier(verifier)
    if drafter is not None and verifier is None:
        raise ValueError("verifier=None is invalid with a drafter: allowed are a Verifier or a registered name")
    return verifier


@dataclass
class _Row:
    """One prompt being decoded: what it committed, its random streams, its policies and its record."""

    prompt: torch.Tensor  # CPU LongTensor[P]
    generator: torch.Generator  # the live stream
    shadow_generator: torch.Generator  # the shadows' stream
    length: DraftLength  # the row's own draft-length policy
    stop_when: StopWhen | None = None
    tokens: list[int] = field(default_factory=list)  # new tokens
    steps: list[StepRecord] = field(default_factory=list)
    context: torch.Tensor | None = None  # CPU LongTensor: prompt + new tokens
    reason: str | None = None
    decode_s: float = 0.0  # the method's seconds of the steps the row took part in

    @classmethod
    def make(cls, prompt: list[int] | torch.Tensor, seed: int | None, device: torch.device, length: DraftLength,
             stop_when: StopWhen | None, generator: torch.Generator | None = None, index: int | None = None) -> _Row:  # fmt: skip
        """A row for ``prompt``: its live stream is ``generator`` or seeded with ``seed`` (None: 0) on ``device``,
        its shadows' stream seeded with seed + 1. ``index``: the prompt's place, for the error of an empty one."""
        prompt = torch.as_tensor(prompt, dtype=torch.long).flatten().cpu()
        if prompt.numel() == 0:
            where = "prompt_ids is empty" if index is None else f"prompt {index} is empty"
            raise ValueError(f"{where}: allowed is a prompt of at least one token")
        seed = 0 if seed is None else seed
        live = generator if generator is not None else torch.Generator(device=device).manual_seed(seed)
        return cls(prompt, live, torch.Generator(device=device).manual_seed(seed + 1), length, stop_when)


@torch.inference_mode()
def decode(
    target: Any,
    drafter: Drafter | None,
    verifier: Verifier | str | None,
    prompt_ids: list[int] | torch.Tensor,
    *,
    max_new_tokens: int = 128,
    gamma: int = DEFAULT_LENGTH.gamma,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Iterable[int] = (),
    seed: int | None = 0,
    generator: torch.Generator | None = None,
    shadow: Sequence[Verifier | str] = (),
    draft_length: DraftLength | None = None,
    fidelity: bool = False,
    stop_when: StopWhen | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> DecodeResult:
    """Decode one prompt with speculative decoding (or autoregressively when ``drafter`` is None): the
    engine's batch of one.

    target: a transformers causal LM. drafter: a Drafter or None. verifier: a Verifier or a
    registered name (ignored without a drafter). prompt_ids: the prompt token ids.
    Sampling uses ``generator`` or a fresh one seeded with ``seed`` on the target's device.
    shadow: verifiers that judge every step's drafts and logits beside the live one without
    changing the output; each step records how many drafts each would have kept. They draw
    from their own generator (seeded with seed + 1), so the live random stream (and the output) is
    the same with and without them.
    draft_length: the policy that sets each step's number of drafts (default: always ``gamma``).
    fidelity: also record, per step, what the live verifier and each shadow cost against the
    target at every judged position (``decoding/fidelity.py``), outside the method's time.
    stop_when: called with the new tokens so far after every step; True ends decoding there (e.g.
    ``StopStrings``: a stop string in the decoded text), so at most one step's tokens follow the stop.
    on_tokens: called with the number of new tokens so far after the prefill and after every step (a
    progress bar), outside the method's time.
    """
    sampling = SamplingParams(temperature, top_p, top_k)
    settings = DecodeSettings(max_new_tokens, gamma, tuple(stop_token_ids))
    verifier = resolve_verifier(drafter, verifier)
    device = input_device(target)
    length = draft_length or FixedLength(settings.gamma)
    row = _Row.make(prompt_ids, seed, device, length, stop_when, generator)
    shadows = tuple(get_verifier(v) if isinstance(v, str) else v for v in shadow)
    return _Batch(target, drafter, verifier, sampling, settings, 1, shadows=shadows, fidelity=fidelity,
                  on_tokens=on_tokens).run([row])[0]  # fmt: skip


@torch.inference_mode()
def decode_batch(
    target: Any,
    drafter: Drafter | None,
    verifier: Verifier | str | None,
    prompts: Sequence[list[int] | torch.Tensor],
    *,
    max_new_tokens: int = 128,
    gamma: int = DEFAULT_LENGTH.gamma,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] = (),
    seeds: Sequence[int] | None = None,
    pad_token_id: int = 0,
    shadow: Sequence[Verifier | str] = (),
    draft_length: DraftLength | None = None,
    fidelity: bool = False,
    stop_when: StopWhen | Sequence[StopWhen | None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> list[DecodeResult]:
    """Decode ``prompts`` together, drafts of at most ``gamma`` tokens; a ``DecodeResult`` per prompt, in order.

    seeds: each prompt's seed (default 0 for every one), as ``decode``'s ``seed``. pad_token_id: the
    token fed in padded slots (never attended to). shadow, fidelity: as ``decode``'s, per row (each
    row's shadows draw from its own stream, seeded as ``decode`` seeds them). draft_length: the policy
    each row starts from (a copy per row, so a ``schedule`` adapts to that row's acceptance). stop_when:
    as ``decode``'s, one for every row or one per prompt. on_tokens: as ``decode``'s, with the new tokens
    of every row together. A result's ``prefill_s`` is the batch's prefill and its ``decode_s`` the
    method's seconds of the batch's steps up to the row's last (its latency in the batch, less shadows
    and fidelity); its steps' phase seconds are the batch's. One prompt decodes exactly as ``decode``.
    """
    sampling = SamplingParams(temperature, top_p, top_k)
    settings = DecodeSettings(max_new_tokens, gamma, tuple(stop_token_ids))
    verifier = resolve_verifier(drafter, verifier)
    if not prompts:
        raise ValueError("prompts is empty: allowed is at least one prompt")
    seeds = [0] * len(prompts) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: got {len(seeds)} for {len(prompts)} prompts: allowed is one seed per prompt")
    stops = list(stop_when) if isinstance(stop_when, Sequence) else [stop_when] * len(prompts)
    if len(stops) != len(prompts):
        raise ValueError(f"stop_when: got {len(stops)} for {len(prompts)} prompts: allowed is one or one per prompt")
    if len(prompts) > 1:
        check_tree_attention(target)  # the batch's rows attend through a 4D mask
    device = input_device(target)
    length = draft_length or FixedLength(settings.gamma)
    rows = [_Row.make(prompt, seed, device, copy.deepcopy(length), stop, index=index)
            for index, (prompt, seed, stop) in enumerate(zip(prompts, seeds, stops))]  # fmt: skip
    shadows = tuple(get_verifier(v) if isinstance(v, str) else v for v in shadow)
    return _Batch(target, drafter, verifier, sampling, settings, len(rows), pad_token_id, shadows, fidelity,
                  on_tokens).run(rows)  # fmt: skip


class _NoDrafts(Drafter):
    """The AR baseline's drafter: no row drafts."""

    name = "none"

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator | None]) -> list[Draft | None]:  # fmt: skip
        return [None] * len(contexts)


@dataclass(frozen=True)
class _Block:
    """One step's target input: each row's root (its newest token), then its drafts.

    tokens: LongTensor[B, W] on the device, right-padded; fed: BoolTensor[B, W], the real slots (None:
    one row, all real); parents: LongTensor[B, W] on the host, each slot's parent slot (None: every row a
    chain); trees: per row, whether its drafts form a tree; node_parents: per row, its drafts' parents
    (CPU LongTensor[N_b], the chain's for a chain).
    """

    tokens: torch.Tensor
    fed: torch.Tensor | None
    parents: torch.Tensor | None
    trees: list[bool]
    node_parents: list[torch.Tensor]


@dataclass(frozen=True)
class _Aside:
    """What a step measured outside the method's time for one row: the drafts each shadow keeps, the
    fidelity costs (None when off or without drafts) and their seconds."""

    shadow_accepted: list[int] = field(default_factory=list)
    costs: list[PositionCosts] | None = None
    fidelity_s: float = 0.0


class _Batch:
    """The rows still decoding, their shared cache, their drafter and the clock that times them."""

    def __init__(self, target: Any, drafter: Drafter | None, verifier: Verifier | None, sampling: SamplingParams,
                 settings: DecodeSettings, rows: int, pad_token_id: int = 0, shadows: tuple[Verifier, ...] = (),
                 fidelity: bool = False, on_tokens: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self.target, self.verifier, self.sampling, self.settings = target, verifier, sampling, settings
        self.shadows, self.fidelity = (shadows, fidelity) if drafter is not None else ((), False)
        self.drafter = drafter if drafter is not None else _NoDrafts()
        self.cache = BatchCache(target, rows)
        self.device, self.pad, self.on_tokens = input_device(target), pad_token_id, on_tokens
        self.rows: list[_Row] = []

    def run(self, rows: list[_Row]) -> list[DecodeResult]:
        self.rows = rows
        clock = Clock(self.device)
        self.prefill(rows)
        prefill_s = clock.lap()
        self.report(clock)  # the prefill's tokens
        active = self.leave(rows)
        while active:
            self.step(active, clock)
            active = self.leave(active)
        return [DecodeResult(len(row.prompt), row.tokens, row.steps, prefill_s, row.decode_s, row.reason or "max_new_tokens")
                for row in rows]  # fmt: skip

    def leave(self, rows: list[_Row]) -> list[_Row]:
        """The rows that go on decoding; the others leave the cache and the drafter."""
        still = [index for index, row in enumerate(rows) if row.reason is None]
        if still and len(still) < len(rows):
            self.cache.keep_rows(still)
            self.drafter.keep(still)
        return [rows[index] for index in still]

    def report(self, clock: Clock) -> None:
        """Tell ``on_tokens`` how many new tokens there are so far; its time is left out of the method's."""
        if self.on_tokens is not None:
            self.on_tokens(sum(len(row.tokens) for row in self.rows))
            clock.lap()

    def prefill(self, rows: list[_Row]) -> None:
        """The prompts (left-padded) in one forward; each row's first token, read in one transfer."""
        prompts = [row.prompt for row in rows]
        if self.cache.dense:
            tokens, fed = prompts[0][None], None
        else:
            tokens, fed = padded_rows(prompts, left=True, pad=self.pad, device=self.device)
        logits, features = self.cache.forward(tokens, fed, logits_to_keep=1, hidden_layers=self.drafter.hidden_layers)
        chosen = [choose_tokens(logits[index, -1:], self.sampling, row.generator) for index, row in enumerate(rows)]
        firsts = torch.cat(chosen).tolist()
        width = tokens.shape[1]
        self.drafter.begin(prompts, None if features is None else [features[index, width - len(prompt) :]
                                                                   for index, prompt in enumerate(prompts)])  # fmt: skip
        for row, first in zip(rows, firsts):
            row.tokens, stopped = cut_at_stop([first], self.settings.stop_token_ids, 1)
            row.context = torch.cat([row.prompt, torch.tensor(row.tokens)])
            row.reason = self.stop_reason(row, stopped)

    def step(self, rows: list[_Row], clock: Clock) -> None:
        """One draft -> target forward -> verify -> commit step for every row in the batch."""
        limits = [min(row.length.next(), self.settings.max_new_tokens - len(row.tokens) - 1) for row in rows]
        proposed = self.drafter.propose([row.context for row in rows], limits, self.sampling, [row.generator for row in rows])
        drafts = [draft if draft is not None and len(draft) else None for draft in proposed]
        draft_s = clock.lap()
        block = self.block(rows, drafts)
        logits, features = self.cache.forward(block.tokens, block.fed, block.parents, hidden_layers=self.drafter.hidden_layers)
        target_s = clock.lap()
        verdicts, next_tokens, verify_s, aside = self.judge(rows, drafts, block, logits, clock)
        paths = [[] if verdict is None else verdict.accepted.tolist() for verdict in verdicts]
        kept = [[0] + [node + 1 for node in path] for path in paths]  # each row's root and accepted nodes, as block slots
        self.cache.commit(kept)
        self.drafter.accept(paths, None if features is None else [features[index, slots] for index, slots in enumerate(kept)])
        records = [self.commit(row, draft, verdict, token, path, row_aside, tree, (draft_s, target_s, verify_s))
                   for row, draft, verdict, token, path, row_aside, tree
                   in zip(rows, drafts, verdicts, next_tokens, paths, aside, block.trees)]  # fmt: skip
        bookkeeping_s = clock.lap()
        for row, record in zip(rows, records):
            record.bookkeeping_s = bookkeeping_s
            row.decode_s += record.draft_s + record.target_s + record.verify_s + record.bookkeeping_s
        self.report(clock)

    def judge(self, rows: list[_Row], drafts: list[Draft | None], block: _Block, logits: torch.Tensor,
              clock: Clock) -> tuple[list[Verdict | None], list[int], float, list[_Aside]]:  # fmt: skip
        """Each row's verdict (None where no row drafted) and next token, the verification's seconds, and what
        was measured aside (shadows, fidelity). ``logits``: [B, W, V], each row's block's."""
        if not any(draft is not None for draft in drafts):  # no row drafted (the AR baseline): tokens from the roots' logits
            next_tokens = torch.cat([choose_tokens(logits[index, :1], self.sampling, row.generator)
                                     for index, row in enumerate(rows)]).tolist()  # fmt: skip
            return [None] * len(rows), next_tokens, clock.lap(), [_Aside() for _ in rows]
        steps = self.verify_inputs(drafts, block, logits, [len(row.tokens) for row in rows])
        verdicts = self.verify(rows, steps)
        verify_s = clock.lap()
        aside = self.judge_aside(rows, steps, verdicts, block, clock)
        return verdicts, [verdict.next_token for verdict in verdicts], verify_s, aside

    def block(self, rows: list[_Row], drafts: list[Draft | None]) -> _Block:
        """The target's input for this step, built on the device: neither the engine nor a drafter reads the drafts."""
        trees = [draft is not None and draft.parents is not None and not is_chain(draft.parents) for draft in drafts]
        node_parents = [draft.parents.cpu() if tree else chain_parents(0 if draft is None else len(draft))
                        for draft, tree in zip(drafts, trees)]  # fmt: skip
        roots = torch.cat([row.context[-1:] for row in rows]).to(self.device).split(1)  # one copy for every row's root
        slots = [root if draft is None else torch.cat([root, draft.tokens.to(self.device)]) for root, draft in zip(roots, drafts)]
        if self.cache.dense:
            return _Block(slots[0][None], None, block_parents(node_parents[0])[None] if trees[0] else None, trees, node_parents)
        tokens = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True, padding_value=self.pad)
        counts = torch.tensor([len(row_slots) for row_slots in slots])
        fed = (torch.arange(tokens.shape[1]) < counts[:, None]).to(self.device)
        parents = None
        if any(trees):
            parents = torch.full(tuple(tokens.shape), -1, dtype=torch.long)
            for index, nodes in enumerate(node_parents):
                parents[index, : len(nodes) + 1] = block_parents(nodes)
        return _Block(tokens, fed, parents, trees, node_parents)

    def verify_inputs(self, drafts: list[Draft | None], block: _Block, logits: torch.Tensor,
                      generated: list[int]) -> list[VerifyInput]:  # fmt: skip
        """Every row's step, each on its own logits rows. A row without drafts is judged too (its next token),
        and where some rows give q or distributions, every row gives them (1 and [0, V] where it has none).
        ``generated``: each row's new tokens before this step (the exact-first window reads them)."""
        with_probs = any(draft is not None and draft.probs is not None for draft in drafts)
        with_dists = any(draft is not None and draft.dists is not None for draft in drafts)
        no_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        no_dists = torch.zeros(0, logits.shape[-1], device=self.device)
        steps = []
        for index, (draft, parents, before) in enumerate(zip(drafts, block.node_parents, generated)):
            count = 0 if draft is None else len(draft)
            probs = None if draft is None else draft.probs
            dists = None if draft is None else draft.dists
            steps.append(VerifyInput(
                draft_tokens=no_tokens if draft is None else draft.tokens,
                parents=parents,
                target_logits=logits[index, : count + 1],
                sampling=self.sampling,
                draft_probs=(torch.ones(count, device=self.device) if probs is None else probs.float()) if with_probs else None,
                draft_dists=(no_dists if dists is None else dists) if with_dists else None,
                generated=(before,),
            ))  # fmt: skip
        return steps

    def verify(self, rows: list[_Row], steps: list[VerifyInput]) -> list[Verdict]:
        """Every row's verdict in one call (and one host transfer), each row drawing from its own stream."""
        step = steps[0] if len(steps) == 1 else batch_steps(steps)
        return self.verifier.verify_batch(step, generator=[row.generator for row in rows])

    def judge_aside(self, rows: list[_Row], steps: list[VerifyInput], verdicts: list[Verdict], block: _Block,
                    clock: Clock) -> list[_Aside]:  # fmt: skip
        """Per row: the drafts each shadow keeps (each shadow judging the batch in one call, every row from its
        own shadow stream) and its fidelity costs, all left out of the method's time."""
        kept = [[verdict.accepted_len] for verdict in verdicts]
        if self.shadows:
            step = steps[0] if len(steps) == 1 else batch_steps(steps)
            for shadow in self.shadows:
                for row_kept, verdict in zip(kept, shadow.verify_batch(step, generator=[row.shadow_generator for row in rows])):
                    row_kept.append(verdict.accepted_len)
        clock.lap()  # shadow verifiers are left out of the method's time
        if not self.fidelity:
            fidelity_s = clock.lap()
            return [_Aside(row_kept[1:] if step.num_drafts else [], None, fidelity_s) for step, row_kept in zip(steps, kept)]
        aside = []
        for step, verdict, row_kept, tree in zip(steps, verdicts, kept, block.trees):
            verifiers = [self.verifier, *self.shadows]
            costs = step_costs(verifiers, step, row_kept, verdict.accepted.tolist(), chain=not tree) if step.num_drafts else None
            aside.append(_Aside(row_kept[1:] if step.num_drafts else [], costs, clock.lap()))  # so is the fidelity measurement
        return aside

    def commit(self, row: _Row, draft: Draft | None, verdict: Verdict | None, next_token: int, path: list[int],
               aside: _Aside, tree: bool, seconds: tuple[float, float, float]) -> StepRecord:  # fmt: skip
        """The row's accepted drafts and next token, cut at a stop token and the budget, its draft-length policy
        told the outcome, and its step record (the bookkeeping seconds come after)."""
        budget = self.settings.max_new_tokens - len(row.tokens)
        kept = [] if verdict is None else verdict.path_tokens
        if kept is None:  # a verifier that does not report its path's tokens: read the drafts
            drafted_tokens = draft.token_list()
            kept = [drafted_tokens[node] for node in path]
        emitted, stopped = cut_at_stop(kept + [next_token], self.settings.stop_token_ids, budget)
        row.tokens += emitted
        row.context = torch.cat([row.context, torch.tensor(emitted)])
        if draft is not None:
            row.length.observe(int(node_depths(draft.parents).max()) + 1 if tree else len(draft), len(path))
        record = self.record(draft, verdict, next_token, len(emitted), aside, seconds)
        row.steps.append(record)
        row.reason = self.stop_reason(row, stopped)
        return record

    def record(self, draft: Draft | None, verdict: Verdict | None, next_token: int, emitted: int, aside: _Aside,
               seconds: tuple[float, float, float]) -> StepRecord:  # fmt: skip
        """The step record of one row (``verdict`` None: no row drafted, its token was chosen from its logits)."""
        draft_s, target_s, verify_s = seconds
        if verdict is None:
            flags, values = statistic_lists(getattr(self.verifier, "statistics", ()), None)
            return StepRecord(0, 0, 0, next_token, emitted, flags=flags, values=values, draft_s=draft_s, target_s=target_s,
                              verify_s=verify_s)  # fmt: skip
        decisions = verdict.decisions
        flags, values = statistic_lists(self.verifier.statistics, decisions.statistics)
        return StepRecord(
            drafted=0 if draft is None else len(draft),
            accepted=verdict.accepted_len,
            relaxed=decisions.relaxed_count,
            next_token=next_token,
            emitted=emitted,
            reasons=decisions.reasons.tolist(),
            flags=flags,
            values=values,
            shadow_accepted=aside.shadow_accepted,
            fidelity=aside.costs,
            fidelity_s=aside.fidelity_s,
            draft_s=draft_s,
            target_s=target_s,
            verify_s=verify_s,
        )

    def stop_reason(self, row: _Row, at_stop_token: bool) -> str | None:
        """Why ``row`` ends after its tokens so far, or None while it goes on: a stop token, then a stop string
        (``stop_when``), then the budget."""
        if at_stop_token:
            return "stop_token"
        if row.stop_when is not None and row.stop_when(row.tokens):
            return "stop_string"
        if len(row.tokens) >= self.settings.max_new_tokens:
            return "max_new_tokens"
        return None
