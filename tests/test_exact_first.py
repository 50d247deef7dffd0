"""The exact-first window (``with_exact_first(rule, L)``, around any lossy rule): the tokens at generated positions
0..L-1 of each answer are judged by the lossless rule, later ones by the rule itself, per depth within a step, per
request within a batch; its emission is p before L; methods, run lines, labels and shadows name it; the rule's own
settings know nothing of it; a bad value is refused in one line."""

from __future__ import annotations

import pickle
import re
from copy import deepcopy
from dataclasses import replace

import pytest
import torch
from conftest import run_config, tiny_model
from omegaconf import OmegaConf

from mars_bench import build_drafter, decode, get_verifier
from mars_bench.config.method import method_spec, shadow_verifiers
from mars_bench.config.overrides import check_override_keys
from mars_bench.config.run_line import run_line
from mars_bench.decoding.batched import decode_batch
from mars_bench.method import MethodSpec
from mars_bench.verification import (
    Reason,
    VerifyInput,
    batch_steps,
    verifier_from_settings,
    verifier_settings,
    with_exact_first,
)
from mars_bench.verification.emission import fidelity
from mars_bench.verification.exact_first import ExactFirst
from mars_bench.verification.mars import MarsParams
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

L = 5  # the window of the hand-made steps
RELAXING = {"theta": 0.9}  # mars keeps the runner-up of every hand-made row (z2 / z1 = 0.95)
EXACT, RELAXED, REJECTED = int(Reason.EXACT), int(Reason.RELAXED), int(Reason.REJECTED)


def windowed_mars(window: int, **settings: object) -> ExactFirst:
    """``mars`` with ``settings`` inside an exact-first window of ``window`` tokens."""
    return with_exact_first(get_verifier("mars", **settings), window)


def margin_row(vocab: int = 5) -> list[float]:
    """Token 0 on top (10), token 1 the runner-up (9.5): mars(theta=0.9) keeps a drafted 1, exact does not."""
    return [10.0, 9.5] + [-20.0] * (vocab - 2)


def step(drafts: list[int], parents: list[int], generated: int) -> VerifyInput:
    """One greedy request's step whose every row is ``margin_row``, after ``generated`` tokens of its answer."""
    logits = torch.tensor([margin_row()] * (len(drafts) + 1))
    return VerifyInput(torch.tensor(drafts), torch.tensor(parents), logits, generated=(generated,))


def test_a_request_before_the_window_ends_is_judged_strictly_and_one_after_it_relaxed():
    windowed, relaxed = windowed_mars(L, **RELAXING), get_verifier("mars", **RELAXING)
    assert isinstance(windowed, ExactFirst) and windowed.name == "mars" and not windowed.lossless
    assert windowed.statistics == relaxed.statistics  # the rule's own, reported after the window
    steps = [
        step([1, 1], [-1, 0], 1),  # positions 1, 2 (and the next token at 3): all in the window
        step([1, 1], [-1, 0], L),  # positions 5, 6: all after it
        step([0, 1], [-1, 0], L - 1),  # depth 0 at position 4 (exact keeps the top token), depth 1 at 5 (relaxed)
        step([0, 1], [-1, 0], L - 2),  # depth 1 at position 4: exact rejects the runner-up
    ]
    verdicts = windowed.verify_batch(batch_steps(steps))
    assert [verdict.accepted.tolist() for verdict in verdicts] == [[], [0, 1], [0, 1], [0]]
    assert [verdict.decisions.reasons.tolist() for verdict in verdicts] == [
        [REJECTED], [RELAXED, RELAXED], [EXACT, RELAXED], [EXACT, REJECTED]]  # fmt: skip
    triggered = [verdict.decisions.statistics["trigger"].tolist() for verdict in verdicts]
    assert triggered == [[False], [True, True], [False, True], [False, False]]  # the window relaxes nothing
    margins = [verdict.decisions.statistics["margin"].tolist() for verdict in verdicts]  # the rule's: none in the window
    assert [[m == pytest.approx(0.95) for m in found] for found in margins] == [[False], [True, True], [False, True],
                                                                              [False, False]]  # fmt: skip
    assert [verdict.next_token for verdict in verdicts] == [0, 0, 0, 0]
    assert [verdict.path_tokens for verdict in verdicts] == [[], [1, 1], [0, 1], [0]]
    # per request, as each alone; after the window exactly the rule itself
    for alone, verdict in zip(steps, verdicts):
        own = windowed.verify(alone)
        assert own.accepted.tolist() == verdict.accepted.tolist() and own.next_token == verdict.next_token
    assert relaxed.verify(steps[1]).decisions.reasons.tolist() == verdicts[1].decisions.reasons.tolist()


def test_a_tree_crossing_the_window_is_judged_per_depth():
    windowed = windowed_mars(L, **RELAXING)
    # the root's children: 0 (its top token), 1 (its runner-up); each has one child, a runner-up
    tree = lambda generated: step([0, 1, 1, 1], [-1, -1, 0, 1], generated)  # noqa: E731
    crossing = windowed.verify(tree(L - 1))  # depth 0 at position 4: strict; depth 1 at 5: relaxed
    assert crossing.accepted.tolist() == [0, 2] and crossing.decisions.reasons.tolist() == [EXACT, RELAXED]
    before = windowed.verify(tree(L - 2))  # depth 1 at position 4: strict
    assert before.accepted.tolist() == [0] and before.decisions.reasons.tolist() == [EXACT, REJECTED]
    assert before.next_token == 0


def random_step(generator: torch.Generator, drafts: int, generated: int, vocab: int = 6) -> VerifyInput:
    """A sampled chain whose logits are close enough for mars(theta=0.5) to relax and whose drafter favours
    the target's top tokens more than the target does (so that relaxing them changes P_V)."""
    logits = 2.0 + torch.rand(drafts + 1, vocab, generator=generator)
    dists = torch.softmax(8 * logits[:drafts] + torch.randn(drafts, vocab, generator=generator), dim=-1)  # sharper than p
    tokens = torch.multinomial(dists, 1, generator=generator).squeeze(-1) if drafts else torch.zeros(0, dtype=torch.long)
    probs = dists.gather(-1, tokens[:, None]).squeeze(-1)
    return VerifyInput(tokens, torch.arange(-1, drafts - 1), logits, SamplingParams(temperature=1.0), probs, dists,
                       generated=(generated,))  # fmt: skip


def test_sampled_batches_equal_each_request_alone_with_its_own_stream():
    windowed = windowed_mars(L, theta=0.5)
    generator = torch.Generator().manual_seed(0)
    steps = [random_step(generator, drafts, generated) for drafts, generated in ((3, 1), (4, 3), (0, 2), (2, L + 1), (4, L - 1))]
    for seed in range(5):
        streams = [torch.Generator().manual_seed(seed * 10 + index) for index in range(len(steps))]
        verdicts = windowed.verify_batch(batch_steps(steps), generator=streams)
        for index, (alone, verdict) in enumerate(zip(steps, verdicts)):
            own = windowed.verify(alone, generator=torch.Generator().manual_seed(seed * 10 + index))
            assert (own.accepted.tolist(), own.next_token) == (verdict.accepted.tolist(), verdict.next_token)
            assert own.decisions.reasons.tolist() == verdict.decisions.reasons.tolist()


def test_the_emission_before_the_window_ends_is_p_and_after_it_the_rules_own():
    windowed, relaxed = windowed_mars(L, theta=0.5), get_verifier("mars", theta=0.5)
    strict = get_verifier("rejection")
    crossing = random_step(torch.Generator().manual_seed(1), 4, L - 2)  # rows 0, 1 before L; rows 2, 3 from L on
    emission, own = windowed.emission(crossing), relaxed.emission(crossing)
    assert emission.rows.tolist() == [0, 1, 2, 3]
    p = probabilities(process_logits(crossing.target_logits, crossing.sampling), crossing.sampling)[:4]
    costs, own_costs = fidelity(emission, p), fidelity(own, p)
    assert costs.kl[:2].max() < 1e-6 and costs.tv[:2].max() < 1e-6  # KL = TV = 0 up to float32 rounding
    assert own_costs.tv[:2].min() > 1e-3  # the rule itself costs something there
    assert torch.allclose(emission.dist[2:], own.dist[2:]) and torch.allclose(emission.accept[2:], own.accept[2:])
    before, after = replace(crossing, generated=(0,)), replace(crossing, generated=(L,))  # wholly in, wholly after
    assert torch.allclose(windowed.emission(before).dist, strict.emission(before).dist)
    assert torch.allclose(windowed.emission(after).dist, own.dist)
    batched = windowed.emission_batch(batch_steps([before, crossing, after]))
    for joint, alone in zip(batched, map(windowed.emission, (before, crossing, after))):
        assert joint.rows.tolist() == alone.rows.tolist() and torch.allclose(joint.dist, alone.dist)


def perturbed_copy(model, scale: float):
    """The same model with a noisy head: its argmax flips to the runner-up at near-ties (mars relaxes there)."""
    copy = deepcopy(model)
    torch.manual_seed(1)
    copy.lm_head.weight.add_(scale * torch.randn_like(copy.lm_head.weight))
    return copy


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    return target, build_drafter("model", model=perturbed_copy(target, scale=0.1))


PROMPT, TOKENS = [1, 5, 9, 2, 7], 60
MARS = {"theta": 0.5, "guard": "gap"}


def positions(result) -> list[tuple[int, int]]:
    """(generated position, reason) of every judged depth of a decode."""
    found, generated = [], 1  # the prefill's token is position 0
    for record in result.steps:
        found += [(generated + depth, reason) for depth, reason in enumerate(record.reasons)]
        generated += record.emitted
    return found


@pytest.mark.slow  # over a second
def test_greedy_a_window_over_the_whole_answer_decodes_as_exact(pair):
    target, drafter = pair
    kwargs = dict(max_new_tokens=TOKENS, gamma=4)
    exact = decode(target, drafter, "exact", PROMPT, **kwargs)
    windowed = decode(target, drafter, windowed_mars(TOKENS, **MARS), PROMPT, **kwargs)
    assert windowed.tokens == exact.tokens and windowed.relaxed == 0
    assert [s.accepted for s in windowed.steps] == [s.accepted for s in exact.steps]
    window = 20  # part of the answer: the first 20 tokens are exact's, relaxation only after them
    without = get_verifier("mars", **MARS)
    part = decode(target, drafter, windowed_mars(window, **MARS), PROMPT, shadow=[without], **kwargs)
    assert part.tokens[:window] == exact.tokens[:window]
    assert all(position >= window for position, reason in positions(part) if reason == RELAXED) and part.relaxed > 0
    (plain,) = part.shadow_accepted(1)  # the rule without its window, on the same drafts: it relaxes before 20
    starts = [1 + sum(s.emitted for s in part.steps[:index]) for index in range(len(part.steps))]
    assert any(kept > s.accepted for kept, s, start in zip(plain, part.steps, starts) if start + s.drafted <= window)
    batch, short = [PROMPT, [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3]], dict(max_new_tokens=24, gamma=4)
    exact_rows = decode_batch(target, drafter, "exact", batch, **short)
    windowed_rows = decode_batch(target, drafter, windowed_mars(24, **MARS), batch, **short)
    assert [row.tokens for row in windowed_rows] == [row.tokens for row in exact_rows]


def test_a_shadow_with_a_window_judges_the_live_drafts_and_costs_nothing_in_it(pair):
    target, drafter = pair
    shadows = [get_verifier("mars", **MARS), windowed_mars(TOKENS, **MARS)]
    watched = decode(target, drafter, "exact", PROMPT, max_new_tokens=TOKENS, gamma=4, shadow=shadows)
    plain, windowed = watched.shadow_accepted(2)
    assert windowed == [s.accepted for s in watched.steps] and sum(plain) > sum(windowed)
    sampled = decode(target, drafter, "rejection", PROMPT, max_new_tokens=30, gamma=4, temperature=1.0, seed=3,
                     shadow=[windowed_mars(30, **MARS)], fidelity=True)  # fmt: skip
    live, shadow = sampled.fidelity()
    assert shadow["positions"] == live["positions"] > 0
    assert shadow["kl"] == pytest.approx(live["kl"], abs=1e-6) and shadow["tv"] == pytest.approx(live["tv"], abs=1e-5)
    assert shadow["tv"] < 1e-3


def test_the_wrapper_is_named_by_methods_run_lines_labels_and_shadows_and_the_rule_knows_nothing_of_it():
    windowed = windowed_mars(16, theta=0.9)
    assert windowed.describe() == {"name": "mars", "theta": 0.9, "guard": "never", "correction": "residual", "exact_first": 16}
    assert windowed.rule.describe() == {"name": "mars", "theta": 0.9, "guard": "never", "correction": "residual"}
    assert with_exact_first(windowed.rule, 0) is windowed.rule  # no window: the rule itself
    assert verifier_settings("mars") is MarsParams and "exact_first" not in MarsParams.__dataclass_fields__
    assert verifier_from_settings("mars", {"theta": 0.9, "exact_first": 16}).describe() == windowed.describe()
    spec = MethodSpec.create("model", "tv_budget", verifier_settings={"eps": 0.05, "exact_first": 8})
    assert spec.exact_first == 8 and spec.verifier_values == {"eps": 0.05, "exact_first": 8}
    assert isinstance(spec.build_verifier(), ExactFirst) and spec.verifier_label == "tv_budget(eps=0.05,exact_first=8)"
    assert pickle.loads(pickle.dumps(spec)) == spec and deepcopy(spec) == spec
    assert MethodSpec.create("model", "tv_budget").verifier_values == {"eps": 0.1}
    cfg = run_config("verifier=mars", "verifier.exact_first=16", "tuning=none")
    assert method_spec(cfg).exact_first == 16
    assert " verifier=mars(theta=0.9,guard=never,correction=residual,exact_first=16) " in run_line(cfg, method_spec(cfg))
    live = {"name": "mars", "theta": 0.9, "guard": "never", "correction": "residual", "exact_first": 8}
    shadows = ["mars(theta=0.9,exact_first=16)", "mars(theta=0.9)", "tv_budget", "rejection"]
    cfg = OmegaConf.create({"verifier": live, "shadow": shadows})
    labels = {label: getattr(verifier, "window", 0) for label, verifier in shadow_verifiers(cfg).items()}
    assert labels == {
        "mars(theta=0.9,guard=never,correction=residual,exact_first=16)": 16,
        "mars(theta=0.9,guard=never,correction=residual)": 0,
        "tv_budget(eps=0.1,exact_first=8)": 8,  # a bare lossy name takes the live verifier's window, as its shared settings
        "rejection": 0,  # a lossless one takes none
    }


def exact_with_a_window() -> None:
    method_spec(run_config("verifier=exact", "verifier.exact_first=4", "tuning=none"))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: windowed_mars(-1), "exact_first=-1 is invalid: allowed is an integer >= 0 (0 = off)"),
        (lambda: with_exact_first(get_verifier("typical"), 2.5),
         "exact_first=2.5 is invalid: allowed is an integer >= 0 (0 = off)"),
        (lambda: get_verifier("mars", exact_first=4), "verifier mars has no setting 'exact_first': allowed are theta, guard, "
                                                      "correction, sampling, margin_logits, entropy_gate"),
        (lambda: with_exact_first(get_verifier("rejection"), 4),
         "exact_first=4 is invalid with verifier rejection, which is lossless at every token: allowed is 0 (exact_first "
         "wraps a lossy rule)"),
        (lambda: shadow_verifiers(OmegaConf.create({"verifier": {"name": "exact"}, "shadow": ["mars(exact_first=x)"]})),
         "shadow 'mars(exact_first=x)': exact_first='x' is invalid: allowed is an integer >= 0 (0 = off)"),
        (lambda: check_override_keys(["verifier=exact", "verifier.exact_first=4"]),
         "verifier.exact_first is not a setting of verifier=exact: verifier=exact takes no settings"),
        (exact_with_a_window, "exact_first=4 is invalid with verifier exact, which is lossless at every token: allowed is 0 "
                              "(exact_first wraps a lossy rule)"),
        (lambda: windowed_mars(4).verify(VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.ones(2, 3))),
         "verifier mars with exact_first=4 judges by position in the answer: allowed is a step that gives generated "
         "(the tokens each request generated before it)"),
    ],
)  # fmt: skip
def test_a_bad_window_is_refused_in_one_line(build, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        build()
