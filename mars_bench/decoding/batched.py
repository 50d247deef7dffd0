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

This step batches the AR baseline (no drafter) and the drafters that hold no per-sequence state on
a device: ``lookup``. The model drafters come next; ``check_batch_drafter`` refuses the others.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from mars_bench.decoding.draft_length import DEFAULT_LENGTH
from mars_bench.decoding.engine import DecodeSettings, chain_parents, cut_at_stop
from mars_bench.decoding.trace import DecodeResult, StepRecord
from mars_bench.drafting.base import Drafter
from mars_bench.kvcache import check_tree_attention
from mars_bench.placement import input_device
from mars_bench.verification import Verifier, VerifyInput, batch_steps, get_verifier
from mars_bench.verification.sampling import SamplingParams, choose_tokens

BATCHED_DRAFTERS = ("lookup",)  # drafters batched so far, besides none (the AR baseline)


def check_batch_drafter(drafter: Drafter | None) -> None:
    """ValueError, in one line, for a drafter ``decode_batch`` does not batch yet."""
    if drafter is not None and drafter.name not in BATCHED_DRAFTERS:
        allowed = ", ".join(("none", *BATCHED_DRAFTERS))
        raise ValueError(f"drafter={drafter.name!r} is not batched yet (batch_size > 1): allowed are {allowed}")


@dataclass
class _Row:
    """One prompt in the batch: what it committed, its random stream and its record."""

    index: int  # the prompt's place in ``prompts``
    prompt: torch.Tensor  # CPU LongTensor[P]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # new tokens
    steps: list[StepRecord] = field(default_factory=list)
    context: torch.Tensor | None = None  # CPU LongTensor: prompt + new tokens
    valid: int = 0  # cached positions this row attends to (its own tokens but the newest)
    reason: str | None = None
    finished_s: float = 0.0  # seconds from the batch's start to this row's last token


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
) -> list[DecodeResult]:
    """Decode ``prompts`` together, drafts of at most ``gamma`` tokens; a ``DecodeResult`` per prompt, in order.

    seeds: each prompt's seed (default 0 for every one), as ``decode``'s ``seed``. pad_token_id: the
    token fed in padded slots (never attended to). A result's ``prefill_s`` is the batch's prefill and
    its ``decode_s`` the time from the prefill's end to the row's last token (its latency in the batch);
    its steps' phase seconds are the batch's.
    """
    sampling = SamplingParams(temperature, top_p, top_k)
    settings = DecodeSettings(max_new_tokens, gamma, tuple(stop_token_ids))
    if isinstance(verifier, str):
        verifier = get_verifier(verifier)
    if drafter is not None and verifier is None:
        raise ValueError("verifier=None is invalid with a drafter: allowed are a Verifier or a registered name")
    check_batch_drafter(drafter)
    check_tree_attention(target)  # the batch's rows attend through a 4D mask
    if not prompts:
        raise ValueError("prompts is empty: allowed is at least one prompt")
    seeds = [0] * len(prompts) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: got {len(seeds)} for {len(prompts)} prompts: allowed is one seed per prompt")
    device = input_device(target)
    rows = []
    for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
        prompt = torch.as_tensor(prompt, dtype=torch.long).flatten().cpu()
        if prompt.numel() == 0:
            raise ValueError(f"prompt {index} is empty: allowed is a prompt of at least one token")
        rows.append(_Row(index, prompt, torch.Generator(device=device).manual_seed(seed)))
    return _Batch(target, drafter, verifier, sampling, settings, device, pad_token_id).run(rows)


def additive_batch_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 4D additive mask [B, 1, q, kv] for ``allowed`` [B, q, kv] (0 = attend, dtype min = blocked)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class _Batch:
    """The rows still decoding, their shared cache and which cached positions each attends to."""

    def __init__(self, target, drafter, verifier, sampling, settings, device, pad_token_id) -> None:  # noqa: ANN001
        self.target, self.drafter, self.verifier = target, drafter, verifier
        self.sampling, self.settings, self.device, self.pad = sampling, settings, device, pad_token_id
        self.dtype = target.get_input_embeddings().weight.dtype
        self.cache = DynamicCache(config=target.config)
        self.attended = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [B, cached]: positions each row sees

    def forward(self, tokens: torch.Tensor, fed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, n, V] for ``tokens`` [B, n] appended to the cache; ``fed`` [B, n]: the real (not
        padded) slots, each attending to its row's valid positions and the real slots before it."""
        count = tokens.shape[1]
        causal = torch.ones(count, count, dtype=torch.bool, device=self.device).tril()
        new = causal[None] & fed[:, None, :]
        allowed = torch.cat([self.attended[:, None, :].expand(-1, count, -1), new], dim=2)
        out = self.target(input_ids=tokens, attention_mask=additive_batch_mask(allowed, self.dtype),
                          position_ids=positions, cache=self.cache, use_cache=True)  # fmt: skip
        return out.logits

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
        """Only the rows ``indices`` (of the current batch) stay in the cache and the masks."""
        if len(indices) == self.attended.shape[0]:
            return
        selected = torch.tensor(indices, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(selected)
        self.attended = self.attended.index_select(0, selected)

    def prefill(self, rows: list[_Row]) -> list[_Row]:
        """The prompts, left-padded, in one forward; each row's first token. Returns the rows it finished."""
        longest = max(len(row.prompt) for row in rows)
        tokens = torch.full((len(rows), longest), self.pad, dtype=torch.long)
        fed = torch.zeros(len(rows), longest, dtype=torch.bool)
        for index, row in enumerate(rows):
            tokens[index, longest - len(row.prompt) :] = row.prompt
            fed[index, longest - len(row.prompt) :] = True
        tokens, fed = tokens.to(self.device), fed.to(self.device)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & fed[:, None, :]
        positions = (fed.long().cumsum(dim=1) - 1).clamp(min=0)
        out = self.target(input_ids=tokens, attention_mask=additive_batch_mask(allowed, self.dtype), position_ids=positions,
                          cache=self.cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        self.attended = fed
        finished = []
        for index, row in enumerate(rows):
            first = int(choose_tokens(out.logits[index, -1:], self.sampling, row.generator)[0])
            row.tokens, stopped = cut_at_stop([first], self.settings.stop_token_ids, 1)
            row.context = torch.cat([row.prompt, torch.tensor(row.tokens)])
            row.valid = len(row.prompt)
            if stopped or len(row.tokens) >= self.settings.max_new_tokens:
                row.reason = "stop_token" if stopped else "max_new_tokens"
                finished.append(row)
        return finished

    def step(self, rows: list[_Row], start: float) -> None:
        """One draft -> target forward -> verify -> commit step for every row in the batch."""
        clock = time.perf_counter()
        drafts = [self.draft(row) for row in rows]
        draft_s = time.perf_counter() - clock
        width = 1 + max(len(tokens) for tokens, _ in drafts)
        tokens = torch.full((len(rows), width), self.pad, dtype=torch.long)
        fed = torch.zeros(len(rows), width, dtype=torch.bool)
        for index, (row, (drafted, _)) in enumerate(zip(rows, drafts)):
            tokens[index, : len(drafted) + 1] = torch.tensor([int(row.context[-1]), *drafted])
            fed[index, : len(drafted) + 1] = True
        tokens, fed = tokens.to(self.device), fed.to(self.device)
        valid = torch.tensor([row.valid for row in rows], device=self.device)
        logits = self.forward(tokens, fed, valid[:, None] + torch.arange(width, device=self.device))
        target_s = time.perf_counter() - clock - draft_s
        verdicts = self.verify(rows, drafts, logits)
        verify_s = time.perf_counter() - clock - draft_s - target_s
        kept = torch.tensor([verdict.accepted_len + 1 for verdict in verdicts], device=self.device)
        # The root and the accepted drafts stay attended; rejected and padded slots never are again.
        self.attended = torch.cat([self.attended, torch.arange(width, device=self.device)[None] < kept[:, None]], dim=1)
        cached = self.attended.shape[1] - width + max(verdict.accepted_len for verdict in verdicts) + 1
        self.crop(cached)
        for row, (drafted, _), verdict in zip(rows, drafts, verdicts):
            self.commit(row, drafted, verdict, (draft_s, target_s, verify_s), start)

    def draft(self, row: _Row) -> tuple[list[int], Any]:
        """The row's drafts (host token ids) and its ``Draft`` (None without drafts)."""
        budget = self.settings.max_new_tokens - len(row.tokens)
        max_drafts = min(self.settings.gamma, budget - 1)
        if self.drafter is None or max_drafts <= 0:
            return [], None
        draft = self.drafter.propose(row.context, max_drafts, self.sampling, row.generator)
        return draft.token_list(), draft if len(draft) else None

    def verify(self, rows: list[_Row], drafts: list[tuple[list[int], Any]], logits: torch.Tensor) -> list[Any]:
        """Every row's verdict from one ``verify_batch`` call, each row judged on its own logits rows."""
        steps = []
        for index, (drafted, draft) in enumerate(drafts):
            count = len(drafted)
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            steps.append(VerifyInput(
                draft_tokens=draft.tokens if draft is not None else empty,
                parents=chain_parents(count),
                target_logits=logits[index, : count + 1],
                sampling=self.sampling,
                draft_probs=self.probs_of(draft, count),
            ))  # fmt: skip
        verifier = self.verifier or get_verifier("exact")  # the AR baseline: no drafts, so only the next token
        return verifier.verify_batch(batch_steps(steps), generator=[row.generator for row in rows])

    def probs_of(self, draft: Any, count: int) -> torch.Tensor:
        """The drafts' q (1 where the drafter gives none), so that every row of the batch carries one."""
        if draft is not None and draft.probs is not None:
            return draft.probs.float()
        return torch.ones(count, device=self.device)

    def crop(self, length: int) -> None:
        """Drop the cached positions no row attends to past ``length``."""
        surplus = self.cache.get_seq_length() - length
        if surplus > 0:
            self.cache.crop(-surplus)
        self.attended = self.attended[:, :length]

    def commit(self, row: _Row, drafted: list[int], verdict: Any, seconds: tuple[float, float, float], start: float) -> None:
        """The row's accepted drafts and next token, cut at a stop token and the budget; its step record."""
        budget = self.settings.max_new_tokens - len(row.tokens)
        proposed = drafted[: verdict.accepted_len] + [verdict.next_token]
        emitted, stopped = cut_at_stop(proposed, self.settings.stop_token_ids, budget)
        row.tokens += emitted
        row.context = torch.cat([row.context, torch.tensor(emitted)])
        row.valid += verdict.accepted_len + 1
        decisions = verdict.decisions
        draft_s, target_s, verify_s = seconds
        row.steps.append(StepRecord(
            drafted=len(drafted), accepted=verdict.accepted_len, relaxed=decisions.relaxed_count,
            next_token=verdict.next_token, emitted=len(emitted), reasons=decisions.reasons.tolist(),
            margins=decisions.margin.tolist(), top1_logits=decisions.top1_logit.tolist(),
            top2_logits=decisions.top2_logit.tolist(),
            triggered=None if decisions.triggered is None else decisions.triggered.tolist(),
            draft_s=draft_s, target_s=target_s, verify_s=verify_s,
        ))  # fmt: skip
        if stopped or len(row.tokens) >= self.settings.max_new_tokens:
            row.reason = "stop_token" if stopped else "max_new_tokens"
            row.finished_s = time.perf_counter() - start
