"""The exact-first window: a wrapper that judges the first L generated tokens of each answer losslessly.

``ExactFirst(rule, L)`` (``with_exact_first``) wraps any lossy rule: the drafts at generated positions 0..L-1
of each answer are judged by the lossless rule (``exact`` when greedy, ``rejection`` when sampling), later
ones by the wrapped rule. This is SecureSD's safety correction, its eta step schedule: exact speculative
decoding for the first L tokens of each answer, the relaxed rule after them. The rule's own settings know
nothing of it; a method names it with its one setting, ``exact_first`` (``WINDOW``): ``verifier.exact_first=16``
on the command line, ``mars(theta=0.9,exact_first=16)`` as a shadow, and labels and records carry it after the
rule's settings (``describe``). ``verifier_from_settings`` builds a rule from such keys.

Positions: an answer's first token (the prefill's, the target's own choice) is position 0; a step of a
request that generated g tokens before it (``VerifyInput.generated``) judges its depth-d drafts at g + d,
and the token after a kept depth-d draft lies at g + d + 1.

A step that begins before L and reaches L is judged per depth, not cut short: its nodes of depth < k = L - g
are one request for the lossless rule (the head), and the subtree below each node of depth k - 1 is one
request for the lossy rule (a tail, rooted at that node's target-logits row; empty where the node has no
children, so that the token at position L is the lossy rule's). The walk takes the head's path and, where
that reaches depth k - 1, the path of the tail below its last node. Each rule judges a row from that row
alone, so P_V is exactly p before L and the lossy rule's own P_V from L on, and ``emission`` states it from
the same pieces. The drafts are the drafter's, unchanged: a shadow with a window judges the live drafts.

A batch goes to at most two calls, the lossless one and then the lossy one, each over all the requests'
pieces (no loop per token); a request's pieces draw from its own stream in that order, so a request's
verdict does not depend on the others in its batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from mars_bench.common.trees import depths_of
from mars_bench.verification.base import (
    Decisions,
    Statistic,
    Verdict,
    Verifier,
    VerifyInput,
    batch_steps,
    get_verifier,
)
from mars_bench.verification.emission import Emission
from mars_bench.verification.sampling import Generators, RandomStreams

WINDOW = "exact_first"  # the wrapper's one setting, as methods, labels and records name it


def check_window(value: object) -> int:
    """``exact_first`` must be an integer >= 0 (0: no window); returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{WINDOW}={value!r} is invalid: allowed is an integer >= 0 (0 = off)")
    return value


def with_exact_first(rule: Verifier, window: object) -> Verifier:
    """``rule`` inside an exact-first window of ``window`` tokens (``ExactFirst``); ``rule`` itself at 0. A lossless
    rule takes no window (every token of its answers is lossless already): ValueError in one line."""
    if not check_window(window):
        return rule
    if rule.lossless:
        raise ValueError(f"{WINDOW}={window} is invalid with verifier {rule.name}, which is lossless at every token: "
                         f"allowed is 0 ({WINDOW} wraps a lossy rule)")  # fmt: skip
    return ExactFirst(rule, window)


def verifier_from_settings(name: str, settings: Mapping[str, object]) -> Verifier:
    """The verifier ``name`` with its own settings, inside the exact-first window where ``settings`` give
    ``exact_first`` (the keys a method, a shadow label or a description names a verifier by)."""
    own = {key: value for key, value in settings.items() if key != WINDOW}
    return with_exact_first(get_verifier(name, **own), settings.get(WINDOW, 0))


@dataclass(frozen=True)
class Split:
    """One request's drafts, split where its step crosses the window's end (``window_split``).

    head: its nodes of depth < k, in order, and their parents among them (head_parents); tails: per node
    of depth k - 1 (the anchor), the nodes below it, in order, and their parents among them (-1: the anchor).
    No tails: every position of the step lies in the window (head is then every node).
    """

    head: tuple[int, ...]
    head_parents: tuple[int, ...]
    tails: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


@lru_cache(maxsize=256)
def window_split(parents: tuple[int, ...], inside: int) -> Split:
    """The split of a request's ``parents`` whose first ``inside`` (k >= 1) positions lie in the window."""
    depths = depths_of(parents).tolist()
    if max(depths, default=-1) < inside - 1:  # the token after the deepest draft is at a position < L as well
        return Split(tuple(range(len(parents))), parents, ())
    head = tuple(node for node, depth in enumerate(depths) if depth < inside)
    where = {node: index for index, node in enumerate(head)}
    head_parents = tuple(-1 if parents[node] < 0 else where[parents[node]] for node in head)
    anchor_of: dict[int, int] = {}
    below: dict[int, list[int]] = {node: [] for node in head if depths[node] == inside - 1}
    for node, depth in enumerate(depths):
        if depth >= inside:  # parents come first, so the parent's anchor is known
            anchor_of[node] = parents[node] if depths[parents[node]] == inside - 1 else anchor_of[parents[node]]
            below[anchor_of[node]].append(node)
    tails = []
    for anchor, nodes in below.items():
        local = {node: index for index, node in enumerate(nodes)}
        tails.append((anchor, tuple(nodes), tuple(-1 if parents[node] == anchor else local[parents[node]] for node in nodes)))
    return Split(head, head_parents, tuple(tails))


@dataclass(frozen=True)
class Piece:
    """A request's share of one rule's call: its step (one request) and where that step's nodes and rows lie
    in the request (``nodes``: the request's index of each node; ``rows``: the request's target-logits row of
    each row, root first; None for both: the piece is the whole request)."""

    request: int
    step: VerifyInput
    nodes: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None

    def node(self, index: int) -> int:
        return index if self.nodes is None else self.nodes[index]


@dataclass(frozen=True)
class Route:
    """Where one request's verdict comes from: its head among the lossless pieces (None: the lossy rule
    judges the whole request, ``whole`` among the lossy pieces) and each anchor's tail among the lossy pieces."""

    head: int | None
    whole: int | None = None
    tails: dict[int, int] | None = None


def take(values: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    """``values[index]`` along dim 0: a view where ``index`` is a run of consecutive indices (a chain's head or tail)."""
    if not index or index == tuple(range(index[0], index[0] + len(index))):
        start = index[0] if index else 0
        return values[start : start + len(index)]
    return values[torch.tensor(index, dtype=torch.long, device=values.device)]


def piece(request: int, step: VerifyInput, nodes: tuple[int, ...], parents: tuple[int, ...], root_row: int) -> Piece:
    """The step judging ``nodes`` of a request's ``step`` (their ``parents`` among them), from its row ``root_row``."""
    rows = (root_row, *(node + 1 for node in nodes))
    part = VerifyInput(
        draft_tokens=take(step.draft_tokens, nodes),
        parents=torch.tensor(parents, dtype=torch.long),
        target_logits=take(step.target_logits, rows),
        sampling=step.sampling,
        draft_probs=None if step.draft_probs is None else take(step.draft_probs, nodes),
        draft_dists=None if step.draft_dists is None else take(step.draft_dists, nodes),
    )
    return Piece(request, part, nodes, rows)


def requests_of(step: VerifyInput) -> list[VerifyInput]:
    """Each request's own step of a batched ``step`` (views: request b's N_b drafts and [N_b + 1, V] logits),
    without ``generated``."""
    if step.drafts_per_row is None:
        return [replace(step, generated=None)]
    counts = list(step.drafts_per_row)
    split = lambda values: [None] * len(counts) if values is None else values.split(counts)  # noqa: E731
    logits, probs = step.target_logits.split([count + 1 for count in counts]), split(step.draft_probs)
    parts = zip(step.draft_tokens.split(counts), step.parents.split(counts), logits, probs, split(step.draft_dists))
    return [VerifyInput(drafts, tree, rows, step.sampling, probs, dists) for drafts, tree, rows, probs, dists in parts]


@dataclass(frozen=True)
class Plan:
    """A step's pieces for the lossless rule and for the lossy rule, and each request's route through them."""

    lossless: list[Piece]
    lossy: list[Piece]
    routes: list[Route]


class ExactFirst(Verifier):
    """A lossy ``rule`` inside its window of ``window`` = L > 0 tokens (see the module's docstring): the same
    name, settings, statistics and tree support as the rule it holds, and not lossless. Its description (labels,
    records, manifests) is the rule's with ``exact_first=L`` after its settings. ``with_exact_first`` builds it."""

    lossless = False

    def __init__(self, rule: Verifier, window: int) -> None:
        if rule.lossless or isinstance(rule, ExactFirst) or check_window(window) == 0:
            raise ValueError(f"ExactFirst wraps a lossy rule in a window of {WINDOW} >= 1 tokens: got verifier "
                             f"{rule.name} with {WINDOW}={window}")  # fmt: skip
        self.rule, self.window = rule, window
        self.name, self.params, self.params_type = rule.name, rule.params, rule.params_type
        self.statistics, self.chains_only = rule.statistics, rule.chains_only
        self.strict = {True: get_verifier("exact"), False: get_verifier("rejection")}  # by sampling.greedy

    def describe(self) -> dict[str, object]:
        """The rule's description, then the window: ``{"name": "mars", "theta": 0.9, ..., "exact_first": 16}``."""
        return {**self.rule.describe(), WINDOW: self.window}

    def plan(self, step: VerifyInput) -> Plan:
        """Split ``step`` by each request's position (``VerifyInput.generated``) into the two rules' pieces."""
        step.check()
        if step.generated is None:
            raise ValueError(f"verifier {self.name} with {WINDOW}={self.window} judges by position in the answer: "
                             "allowed is a step that gives generated (the tokens each request generated before it)")  # fmt: skip
        lossless: list[Piece] = []
        lossy: list[Piece] = []
        routes = []
        for request, (own, generated) in enumerate(zip(requests_of(step), step.generated)):
            inside = self.window - generated  # k: this step's positions in the window, from depth 0
            if inside <= 0:
                routes.append(Route(None, whole=len(lossy)))
                lossy.append(Piece(request, own))
                continue
            split = window_split(tuple(own.parents.tolist()), inside)
            if not split.tails:
                routes.append(Route(len(lossless)))
                lossless.append(Piece(request, own))
                continue
            tails = {}
            for anchor, nodes, parents in split.tails:
                tails[anchor] = len(lossy)
                lossy.append(piece(request, own, nodes, parents, anchor + 1))
            routes.append(Route(len(lossless), tails=tails))
            lossless.append(piece(request, own, split.head, split.head_parents, 0))
        return Plan(lossless, lossy, routes)

    def verify_batch(self, step: VerifyInput, *, generator: Generators = None) -> list[Verdict]:
        plan = self.plan(step)
        shared = generator is None or isinstance(generator, torch.Generator)
        streams = None if shared else RandomStreams.of(generator, step.drafts_per_row or (step.num_drafts,)).generators

        def judge(rule: Verifier, pieces: list[Piece]) -> list[Verdict]:
            if not pieces:
                return []
            joined = pieces[0].step if len(pieces) == 1 else batch_steps([each.step for each in pieces])
            return rule.verify_batch(joined, generator=generator if shared else [streams[each.request] for each in pieces])

        strict = judge(self.strict[step.sampling.greedy], plan.lossless)
        relaxed = judge(self.rule, plan.lossy)
        return [self.verdict(route, plan, strict, relaxed) for route in plan.routes]

    def verdict(self, route: Route, plan: Plan, strict: list[Verdict], relaxed: list[Verdict]) -> Verdict:
        """One request's verdict from its pieces' verdicts, in the request's own node indices."""
        if route.head is None:
            return relaxed[route.whole]
        head_piece, head = plan.lossless[route.head], strict[route.head]
        path = [head_piece.node(index) for index in head.accepted.tolist()]
        tail_index = (route.tails or {}).get(path[-1]) if path else None  # the head's walk reached an anchor
        if tail_index is None:
            return Verdict(torch.tensor(path, dtype=torch.long), head.next_token, self.decisions(head.decisions),
                           head.path_tokens)  # fmt: skip
        tail_piece, tail = plan.lossy[tail_index], relaxed[tail_index]
        path += [tail_piece.node(index) for index in tail.accepted.tolist()]
        tokens = None if head.path_tokens is None or tail.path_tokens is None else head.path_tokens + tail.path_tokens
        return Verdict(torch.tensor(path, dtype=torch.long), tail.next_token, self.decisions(head.decisions, tail.decisions),
                       tokens)  # fmt: skip

    def decisions(self, *parts: Decisions) -> Decisions:
        """The visited depths' decisions of the pieces, one after another, with the rule's statistics: the
        lossless piece, judged in the window, has none of them (``Statistic.missing``: a count that never
        happened, a NaN value)."""
        def joined(statistic: Statistic) -> torch.Tensor:
            return torch.cat([part.statistics.get(statistic.name, statistic.missing(len(part.reasons))) for part in parts])

        return Decisions(reasons=torch.cat([part.reasons for part in parts]),
                         statistics={statistic.name: joined(statistic) for statistic in self.statistics})  # fmt: skip

    def emission(self, step: VerifyInput) -> Emission:
        """P_V and alpha_V per judging row of one request's step: p's (the lossless rule's) at the rows
        before L, the lossy rule's from L on."""
        if step.batch_size != 1:
            raise ValueError(f"emission states one request's step, got {step.batch_size}: a batched step goes to emission_batch")
        return self.emission_batch(step)[0]

    def emission_batch(self, step: VerifyInput) -> list[Emission]:
        plan = self.plan(step)

        def state(rule: Verifier, pieces: list[Piece]) -> list[Emission | None]:
            judged = [index for index, each in enumerate(pieces) if each.step.num_drafts]  # an empty tail judges no row
            found = rule.emission_batch(batch_steps([pieces[index].step for index in judged])) if judged else []
            emissions: list[Emission | None] = [None] * len(pieces)
            for index, emission in zip(judged, found):
                emissions[index] = emission
            return emissions

        strict = state(self.strict[step.sampling.greedy], plan.lossless)
        relaxed = state(self.rule, plan.lossy)
        vocab, device = step.target_logits.shape[-1], step.target_logits.device
        result = []
        for route in plan.routes:
            if route.head is None:
                found = [(plan.lossy[route.whole], relaxed[route.whole])]
            else:
                tails = (route.tails or {}).values()
                found = [(plan.lossless[route.head], strict[route.head])] + [(plan.lossy[i], relaxed[i]) for i in tails]
            result.append(joined_emission([(each, emission) for each, emission in found if emission is not None], vocab, device))
        return result


def joined_emission(found: list[tuple[Piece, Emission]], vocab: int, device: torch.device) -> Emission:
    """One request's emission from its pieces' (each in its own rows), in the request's rows, ascending."""
    if len(found) == 1 and found[0][0].rows is None:
        return found[0][1]
    if not found:
        nothing = torch.zeros(0, dtype=torch.long, device=device)
        return Emission(torch.zeros(0, vocab, device=device), torch.zeros(0, device=device), nothing)
    rows = torch.cat([torch.tensor(each.rows, dtype=torch.long, device=device)[emission.rows] for each, emission in found])
    order = rows.argsort()
    dist = torch.cat([emission.dist for _, emission in found])
    accept = torch.cat([emission.accept for _, emission in found])
    return Emission(dist[order], accept[order], rows[order])
