"""The decoding engine: prefill, then draft -> one target forward -> verify -> commit.

The autoregressive baseline is the same loop with no drafter: same model object, same
cache type, same token choice, same stop handling. A tree of drafts is verified in one
target forward with a 4D mask; afterwards the cache keeps the prefix and the accepted
path only (a chain's rejected tail is simply cropped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from mars_bench.common.trees import is_chain, node_depths
from mars_bench.decoding.clock import Clock
from mars_bench.decoding.draft_length import DEFAULT_LENGTH, DraftLength, FixedLength
from mars_bench.decoding.fidelity import step_costs
from mars_bench.decoding.trace import DecodeResult, StepRecord
from mars_bench.drafting.base import Drafter, empty_draft
from mars_bench.models.kvcache import cached_forward, crop_to, keep_positions
from mars_bench.models.placement import input_device
from mars_bench.verification import Verifier, VerifyInput, get_verifier
from mars_bench.verification.sampling import SamplingParams, choose_tokens


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
    stop_when: Callable[[list[int]], bool] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> DecodeResult:
    """Decode one prompt with speculative decoding (or autoregressively when ``drafter`` is None).

    target: a transformers causal LM. drafter: a Drafter or None. verifier: a Verifier or a
    registered name (ignored without a drafter). prompt_ids: the prompt token ids.
    Sampling uses ``generator`` or a fresh one seeded with ``seed`` on the target's device.
    shadow: verifiers that judge every step's drafts and logits beside the live one without
    changing the output; each step records how many drafts each would have kept. They draw
    from their own generator, so the live random stream (and the output) is the same with
    and without them.
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
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
    if prompt.numel() == 0:
        raise ValueError("prompt_ids is empty: allowed is a prompt of at least one token")
    device = input_device(target)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)
    shadow_generator = torch.Generator(device=device)
    shadow_generator.manual_seed((0 if seed is None else seed) + 1)
    shadows = (tuple(get_verifier(v) if isinstance(v, str) else v for v in shadow), shadow_generator)
    length = draft_length or FixedLength(settings.gamma)
    run = _Run(target, drafter, verifier, sampling, settings, generator, device, shadows, length, fidelity, stop_when, on_tokens)
    return run.run(prompt)


class _Run:
    """State of one sequence being decoded."""

    def __init__(self, target, drafter, verifier, sampling, settings, generator, device, shadows, draft_length, fidelity,
                 stop_when, on_tokens) -> None:  # fmt: skip
        self.target, self.drafter, self.verifier = target, drafter, verifier
        self.sampling, self.settings, self.generator, self.device = sampling, settings, generator, device
        self.shadow, self.shadow_generator = shadows
        self.draft_length: DraftLength = draft_length
        self.cache = DynamicCache(config=target.config)
        self.hidden_layers = drafter.hidden_layers if drafter is not None else ()
        self.features: torch.Tensor | None = None  # the drafter's target features for the last forward
        self.fidelity: bool = fidelity
        self.stop_when: Callable[[list[int]], bool] | None = stop_when
        self.on_tokens: Callable[[int], None] | None = on_tokens

    def forward(self, tokens: torch.Tensor, last_only: bool = False, parents: torch.Tensor | None = None) -> torch.Tensor:
        """Target logits [n, V] for the new tokens ([1, V] if ``last_only``); ``parents``: their
        tree within the block (None: a chain). Keeps the drafter's features in ``self.features``."""
        logits, self.features = cached_forward(
            self.target, tokens, self.cache, last_only=last_only, parents=parents, hidden_layers=self.hidden_layers
        )
        return logits

    def run(self, prompt: torch.Tensor) -> DecodeResult:
        clock = Clock(self.device)
        first = int(choose_tokens(self.forward(prompt, last_only=True), self.sampling, self.generator)[0])
        if self.drafter is not None:
            self.drafter.begin(prompt, self.features)
        prefill_s = clock.lap()
        self.report(1, clock)  # the prefill's token
        tokens, stopped = cut_at_stop([first], self.settings.stop_token_ids, 1)
        reason = self.stop_reason(tokens, stopped)
        context = torch.cat([prompt, torch.tensor(tokens)])
        steps: list[StepRecord] = []
        while reason is None and len(tokens) < self.settings.max_new_tokens:
            budget = self.settings.max_new_tokens - len(tokens)
            step, emitted = self.step(context, budget, clock)
            emitted, stopped = cut_at_stop(emitted, self.settings.stop_token_ids, budget)
            step.emitted = len(emitted)
            tokens += emitted
            reason = self.stop_reason(tokens, stopped)
            context = torch.cat([context, torch.tensor(emitted)])
            step.bookkeeping_s += clock.lap()
            steps.append(step)
            self.report(len(tokens), clock)
        decode_s = sum(s.draft_s + s.target_s + s.verify_s + s.bookkeeping_s for s in steps)
        return DecodeResult(len(prompt), tokens, steps, prefill_s, decode_s, reason or "max_new_tokens")

    def report(self, new_tokens: int, clock: Clock) -> None:
        """Tell ``on_tokens`` how many new tokens there are so far; its time is left out of the method's."""
        if self.on_tokens is not None:
            self.on_tokens(new_tokens)
            clock.lap()

    def stop_reason(self, tokens: list[int], at_stop_token: bool) -> str | None:
        """Why decoding ends after ``tokens`` (the new tokens so far), or None while it goes on."""
        if at_stop_token:
            return "stop_token"
        if self.stop_when is not None and self.stop_when(tokens):
            return "stop_string"
        return None

    def step(self, context: torch.Tensor, budget: int, clock: Clock) -> tuple[StepRecord, list[int]]:
        """One step: returns its record (times filled but bookkeeping) and the tokens it emits."""
        max_drafts = min(self.draft_length.next(), budget - 1)
        if self.drafter is not None and max_drafts > 0:
            draft = self.drafter.propose(context, max_drafts, self.sampling, self.generator)
        else:
            draft = empty_draft(self.device)
        draft_tokens = draft.token_list()
        draft_s = clock.lap()
        root = context[-1:].to(self.device)
        tree = draft.parents is not None and not is_chain(draft.parents)
        parents = draft.parents.cpu() if tree else chain_parents(len(draft_tokens))
        logits = self.forward(torch.cat([root, draft.tokens.to(self.device)]), parents=block_parents(parents) if tree else None)
        target_s = clock.lap()
        if not draft_tokens:
            next_token = int(choose_tokens(logits[-1:], self.sampling, self.generator)[0])
            record = StepRecord(0, 0, 0, next_token, 0, draft_s=draft_s, target_s=target_s, verify_s=clock.lap(),
                                triggered=[] if getattr(self.verifier, "has_trigger", False) else None)  # fmt: skip
            if self.drafter is not None:
                self.drafter.accept([], self.features)
            return record, [next_token]
        step_input = VerifyInput(
            draft_tokens=draft.tokens,
            parents=parents,
            target_logits=logits,
            sampling=self.sampling,
            draft_probs=draft.probs,
            draft_dists=draft.dists,
        )
        verdict = self.verifier.verify(step_input, generator=self.generator)
        verify_s = clock.lap()
        shadow_accepted = [shadow.verify(step_input, generator=self.shadow_generator).accepted_len for shadow in self.shadow]
        clock.lap()  # shadow verifiers are left out of the method's time
        costs = None
        if self.fidelity:
            verifiers, kept = [self.verifier, *self.shadow], [verdict.accepted_len, *shadow_accepted]
            costs = step_costs(verifiers, step_input, kept, verdict.accepted.tolist(), chain=not tree)
        fidelity_s = clock.lap()  # so is the fidelity measurement
        accepted, path = verdict.accepted_len, verdict.accepted.tolist()
        self.draft_length.observe(int(node_depths(parents).max()) + 1 if tree else len(draft_tokens), accepted)
        if tree:  # the prefix, the root and the accepted path stay cached
            keep_positions(self.cache, torch.cat([torch.arange(len(context)), len(context) + verdict.accepted]))
        else:
            crop_to(self.cache, len(context) + accepted)
        rows = [0] + [node + 1 for node in path]
        self.drafter.accept(path, None if self.features is None else self.features[rows])
        decisions = verdict.decisions
        record = StepRecord(
            drafted=len(draft_tokens),
            accepted=accepted,
            relaxed=decisions.relaxed_count,
            next_token=verdict.next_token,
            emitted=0,
            reasons=decisions.reasons.tolist(),
            margins=decisions.margin.tolist(),
            top1_logits=decisions.top1_logit.tolist(),
            top2_logits=decisions.top2_logit.tolist(),
            triggered=None if decisions.triggered is None else decisions.triggered.tolist(),
            shadow_accepted=shadow_accepted,
            fidelity=costs,
            fidelity_s=fidelity_s,
            draft_s=draft_s,
            target_s=target_s,
            verify_s=verify_s,
        )
        return record, [draft_tokens[node] for node in path] + [verdict.next_token]
