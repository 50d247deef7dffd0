"""Batched speculative decoding: B prompts decoded together, one target forward per step for every row.

Each row keeps its own prompt length, cache extent, drafts, verdict, acceptance and stop. Rows may
draft different numbers of tokens in a step; a padded slot is masked out of attention and never
judged. A finished row leaves the batch, which shrinks (no refill: that is a serving engine's job).
One ``verify_batch`` call judges every row's drafts, each row drawing from its own random stream,
seeded as ``decode`` seeds one prompt, so a row decodes as it would alone up to the numerics of a
batched matmul.

The KV cache is one ``DynamicCache`` for the batch, the prompts left-padded at the prefill. A
rejected draft's position is masked, not removed, so no step copies the cache; the positions past
every row's accepted path are cropped. A row's position ids count its own valid positions, so its
rotary positions are those it has decoded alone. Masks and positions are built on the device.

The drafters batched so far are the chain drafters ``lookup`` (per row: it has no state) and
``model`` (one batched draft-model forward per draft position, ``drafting/batched.py``);
``check_batch_drafter`` refuses the others in one line.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from mars_bench.decoding.draft_length import DEFAULT_LENGTH, DraftLength, FixedLength
from mars_bench.decoding.engine import DecodeSettings, chain_parents, cut_at_stop, resolve_verifier
from mars_bench.decoding.fidelity import step_costs
from mars_bench.decoding.trace import DecodeResult, StepRecord
from mars_bench.drafting.base import Drafter
from mars_bench.drafting.batched import batch_drafter, check_batch_drafter
from mars_bench.models.kvcache import batch_forward, check_tree_attention, crop_batch, padded_rows, select_batch_rows
from mars_bench.models.placement import input_device
from mars_bench.verification import Verifier, VerifyInput, batch_steps, get_verifier
from mars_bench.verification.sampling import SamplingParams, choose_tokens


@dataclass
class _Row:
    """One prompt in the batch: what it committed, its random stream and its record."""

    index: int  # the prompt's place in ``prompts``
    prompt: torch.Tensor  # CPU LongTensor[P]
    generator: torch.Generator
    shadow_generator: torch.Generator  # the shadows' stream, as ``decode`` seeds it (seed + 1)
    length: DraftLength  # the row's own draft-length policy
    stop_when: Callable[[list[int]], bool] | None = None
    tokens: list[int] = field(default_factory=list)  # new tokens
    steps: list[StepRecord] = field(default_factory=list)
    context: torch.Tensor | None = None  # CPU LongTensor: prompt + new tokens
    reason: str | None = None
    finished_s: float = 0.0  # seconds from the batch's start to this row's last token (less ``aside_s``)
    aside_s: float = 0.0  # seconds of shadows and fidelity until then, outside the method's time


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
    stop_when: Callable[[list[int]], bool] | Sequence[Callable[[list[int]], bool] | None] | None = None,
) -> list[DecodeResult]:
    """Decode ``prompts`` together, drafts of at most ``gamma`` tokens; a ``DecodeResult`` per prompt, in order.

    seeds: each prompt's seed (default 0 for every one), as ``decode``'s ``seed``. pad_token_id: the
    token fed in padded slots (never attended to). shadow, fidelity: as ``decode``'s, per row (each
    row's shadows draw from its own stream, seeded as ``decode`` seeds them). draft_length: the policy
    each row starts from (a copy per row, so a ``schedule`` adapts to that row's acceptance). stop_when:
    as ``decode``'s, one for every row or one per prompt. A result's ``prefill_s`` is the batch's prefill
    and its ``decode_s`` the time from the prefill's end to the row's last token (its latency in the
    batch); its steps' phase seconds are the batch's.
    """
    sampling = SamplingParams(temperature, top_p, top_k)
    settings = DecodeSettings(max_new_tokens, gamma, tuple(stop_token_ids))
    verifier = resolve_verifier(drafter, verifier)
    check_batch_drafter(drafter)
    check_tree_attention(target)  # the batch's rows attend through a 4D mask
    if not prompts:
        raise ValueError("prompts is empty: allowed is at least one prompt")
    seeds = [0] * len(prompts) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: got {len(seeds)} for {len(prompts)} prompts: allowed is one seed per prompt")
    stops = list(stop_when) if isinstance(stop_when, Sequence) else [stop_when] * len(prompts)
    if len(stops) != len(prompts):
        raise ValueError(f"stop_when: got {len(stops)} for {len(prompts)} prompts: allowed is one or one per prompt")
    device = input_device(target)
    length = draft_length or FixedLength(settings.gamma)
    rows = []
    for index, (prompt, seed, stop) in enumerate(zip(prompts, seeds, stops)):
        prompt = torch.as_tensor(prompt, dtype=torch.long).flatten().cpu()
        if prompt.numel() == 0:
            raise ValueError(f"prompt {index} is empty: allowed is a prompt of at least one token")
        streams = [torch.Generator(device=device).manual_seed(value) for value in (seed, seed + 1)]
        rows.append(_Row(index, prompt, *streams, copy.deepcopy(length), stop))
    shadows = tuple(get_verifier(v) if isinstance(v, str) else v for v in shadow)
    return _Batch(target, drafter, verifier, sampling, settings, device, pad_token_id, shadows, fidelity).run(rows)


class _Batch:
    """The rows still decoding, their shared cache and which cached positions each attends to."""

    def __init__(self, target, drafter, verifier, sampling, settings, device, pad_token_id, shadows, fidelity) -> None:
        # The AR baseline drafts nothing, so exact only picks each row's next token.
        self.target, self.verifier = target, verifier if drafter is not None else get_verifier("exact")
        self.shadows, self.fidelity = (shadows, fidelity) if drafter is not None else ((), False)
        self.drafts = batch_drafter(drafter)
        self.sampling, self.settings, self.device, self.pad = sampling, settings, device, pad_token_id
        self.cache = DynamicCache(config=target.config)
        self.attended = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [B, cached]: positions each row sees

    def run(self, rows: list[_Row]) -> list[DecodeResult]:
        start = time.perf_counter()
        finished = self.prefill(rows)
        prefill_s = time.perf_counter() - start
        active = [row for row in rows if row.reason is None]
        self.keep([index for index, row in enumerate(rows) if row.reason is None])
        for row in finished:
            row.finished_s = prefill_s
        while active:
            self.step(active, start)
            still = [index for index, row in enumerate(active) if row.reason is None]
            if len(still) < len(active):
                self.keep(still)
                active = [active[index] for index in still]
        return [DecodeResult(len(row.prompt), row.tokens, row.steps, prefill_s, row.finished_s - prefill_s,
                             row.reason or "max_new_tokens") for row in rows]  # fmt: skip

    def keep(self, indices: list[int]) -> None:
        """Only the rows ``indices`` (of the current batch) stay in the cache, the masks and the drafter."""
        self.attended = select_batch_rows(self.cache, self.attended, indices)
        self.drafts.keep(indices)

    def prefill(self, rows: list[_Row]) -> list[_Row]:
        """The prompts, left-padded, in one forward; each row's first token. Returns the rows it finished."""
        tokens, fed = padded_rows([row.prompt for row in rows], left=True, pad=self.pad, device=self.device)
        empty = torch.zeros(len(rows), 0, dtype=torch.bool, device=self.device)
        logits, self.attended = batch_forward(self.target, self.cache, empty, tokens, fed, 1)
        self.drafts.begin([row.prompt for row in rows])
        finished = []
        chosen = [choose_tokens(logits[index, -1:], self.sampling, row.generator) for index, row in enumerate(rows)]
        firsts = torch.cat(chosen).tolist()  # every row's first token in one read
        for row, first in zip(rows, firsts):
            row.tokens, stopped = cut_at_stop([first], self.settings.stop_token_ids, 1)
            row.context = torch.cat([row.prompt, torch.tensor(row.tokens)])
            row.reason = self.stop_reason(row, stopped)
            if row.reason is not None:
                finished.append(row)
        return finished

    def step(self, rows: list[_Row], start: float) -> None:
        """One draft -> target forward -> verify -> commit step for every row in the batch."""
        clock = time.perf_counter()
        drafts = self.draft(rows)
        draft_s = time.perf_counter() - clock
        tokens, fed = self.feed(rows, drafts)
        width = tokens.shape[1]
        logits, attended = batch_forward(self.target, self.cache, self.attended, tokens, fed)
        target_s = time.perf_counter() - clock - draft_s
        steps = self.verify_inputs(drafts, logits)
        batch = batch_steps(steps)
        verdicts = self.verifier.verify_batch(batch, generator=[row.generator for row in rows])
        verify_s = time.perf_counter() - clock - draft_s - target_s
        outside = time.perf_counter()  # the shadows and the fidelity measurement are left out of the method's time
        judged = self.judge_aside(rows, steps, batch, verdicts)
        aside_s = time.perf_counter() - outside
        # The root and the accepted drafts stay attended; rejected and padded slots never are again.
        kept = torch.tensor([verdict.accepted_len + 1 for verdict in verdicts], device=self.device)
        attended[:, -width:] &= torch.arange(width, device=self.device)[None] < kept[:, None]
        cached = attended.shape[1] - width + max(verdict.accepted_len for verdict in verdicts) + 1
        self.attended = crop_batch(self.cache, attended, cached)
        self.drafts.accept([verdict.accepted_len for verdict in verdicts])
        for row, draft, verdict, aside in zip(rows, drafts, verdicts, judged):
            self.commit(row, draft, verdict, (draft_s, target_s, verify_s), aside, start, aside_s)

    def draft(self, rows: list[_Row]) -> list[Any]:
        """Each row's ``Draft`` (None without drafts), its tokens on the device: the host learns the kept
        ones with the verdicts (``Verdict.path_tokens``), in the step's one transfer."""
        limits = [min(row.length.next(), self.settings.max_new_tokens - len(row.tokens) - 1) for row in rows]
        proposed = self.drafts.propose([row.context for row in rows], limits, self.sampling, [row.generator for row in rows])
        return [None if draft is None or not len(draft) else draft for draft in proposed]

    def feed(self, rows: list[_Row], drafts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's input, right-padded on the device: each row's root (its newest token, a host
        value), then its drafts (copied on the device); and which slots are real (tokens, fed [B, width])."""
        counts = [0 if draft is None else len(draft) for draft in drafts]
        roots = [[int(row.context[-1])] for row in rows]
        tokens, _ = padded_rows(roots, left=False, pad=self.pad, device=self.device)
        tokens = torch.nn.functional.pad(tokens, (0, max(counts)), value=self.pad)
        for index, draft in enumerate(drafts):
            if draft is not None:
                tokens[index, 1 : 1 + counts[index]] = draft.tokens
        fed = torch.arange(tokens.shape[1]) < torch.tensor(counts)[:, None] + 1
        return tokens, fed.to(self.device)

    def verify_inputs(self, drafts: list[Any], logits: torch.Tensor) -> list[VerifyInput]:
        """Every row's step, each on its own logits rows (judged together by one ``verify_batch`` call)."""
        steps = []
        # A sampling model drafter gives its distributions; then every row carries some (none: [0, V]).
        with_dists = any(draft is not None and draft.dists is not None for draft in drafts)
        no_dists = torch.zeros(0, logits.shape[-1], device=self.device)
        for index, draft in enumerate(drafts):
            count = 0 if draft is None else len(draft)
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            steps.append(VerifyInput(
                draft_tokens=draft.tokens if draft is not None else empty,
                parents=chain_parents(count),
                target_logits=logits[index, : count + 1],
                sampling=self.sampling,
                draft_probs=self.probs_of(draft, count),
                draft_dists=(draft.dists if draft is not None else no_dists) if with_dists else None,
            ))  # fmt: skip
        return steps

    def judge_aside(self, rows: list[_Row], steps: list[VerifyInput], batch: VerifyInput,
                    verdicts: list[Any]) -> list[tuple[list[int], Any, float]]:  # fmt: skip
        """Per row: the drafts each shadow keeps (each shadow judging the batch in one call, every row
        from its own shadow stream), its fidelity costs (None when off or without drafts) and their seconds."""
        kept = [[verdict.accepted_len] for verdict in verdicts]
        for shadow in self.shadows:
            shadow_verdicts = shadow.verify_batch(batch, generator=[row.shadow_generator for row in rows])
            for row_kept, verdict in zip(kept, shadow_verdicts):
                row_kept.append(verdict.accepted_len)
        judged = []
        for step, verdict, row_kept in zip(steps, verdicts, kept):
            clock, costs = time.perf_counter(), None
            if self.fidelity and step.num_drafts:
                costs = step_costs([self.verifier, *self.shadows], step, row_kept, verdict.accepted.tolist(), chain=True)
            judged.append((row_kept[1:] if step.num_drafts else [], costs, time.perf_counter() - clock))
        return judged

    def probs_of(self, draft: Any, count: int) -> torch.Tensor:
        """The drafts' q (1 where the drafter gives none), so that every row of the batch carries one."""
        if draft is not None and draft.probs is not None:
            return draft.probs.float()
        return torch.ones(count, device=self.device)

    def commit(self, row: _Row, draft: Any, verdict: Any, seconds: tuple[float, float, float],
               aside: tuple[list[int], Any, float], start: float, aside_s: float) -> None:  # fmt: skip
        """The row's accepted drafts and next token, cut at a stop token and the budget; its step record.
        ``aside``: the row's shadow counts, fidelity costs and their seconds (``judge_aside``); ``aside_s``:
        the step's seconds spent on shadows and fidelity, left out of the row's finish time."""
        budget = self.settings.max_new_tokens - len(row.tokens)
        drafted = 0 if draft is None else len(draft)
        kept = [] if not drafted else verdict.path_tokens
        if kept is None:  # a verifier that does not report its path's tokens: read the drafts
            kept = draft.token_list()[: verdict.accepted_len]
        proposed = kept + [verdict.next_token]
        emitted, stopped = cut_at_stop(proposed, self.settings.stop_token_ids, budget)
        row.tokens += emitted
        row.context = torch.cat([row.context, torch.tensor(emitted)])
        if drafted:
            row.length.observe(drafted, verdict.accepted_len)
        decisions = verdict.decisions
        draft_s, target_s, verify_s = seconds
        shadow_accepted, costs, fidelity_s = aside
        row.steps.append(StepRecord(
            drafted=drafted, accepted=verdict.accepted_len, relaxed=decisions.relaxed_count,
            next_token=verdict.next_token, emitted=len(emitted), reasons=decisions.reasons.tolist(),
            margins=decisions.margin.tolist(), top1_logits=decisions.top1_logit.tolist(),
            top2_logits=decisions.top2_logit.tolist(),
            triggered=None if decisions.triggered is None else decisions.triggered.tolist(),
            shadow_accepted=shadow_accepted, fidelity=costs, fidelity_s=fidelity_s,
            draft_s=draft_s, target_s=target_s, verify_s=verify_s,
        ))  # fmt: skip
        row.aside_s += aside_s
        row.reason = self.stop_reason(row, stopped)
        if row.reason is not None:
            row.finished_s = time.perf_counter() - start - row.aside_s

    def stop_reason(self, row: _Row, at_stop_token: bool) -> str | None:
        """Why ``row`` ends after its tokens so far (as ``decode`` says it), or None while it goes on."""
        if at_stop_token:
            return "stop_token"
        if len(row.tokens) >= self.settings.max_new_tokens:
            return "max_new_tokens"
        if row.stop_when is not None and row.stop_when(row.tokens):
            return "stop_string"
        return None
