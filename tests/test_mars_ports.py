"""The ports of the MARS rule as settings of ``mars`` (docs/verifiers.md#the-ports-of-mars): SecureSD's
unguarded ratio (``guard=none``), its deterministic sampling with argmax corrections
(``sampling=securesd``) and its raw logits (``margin_logits=raw``), on hand-computed logits; their exact
emission against the verdicts where these settings act (negative logits, a filtered runner-up), which
the cases of test_emission.py, all with positive logits, do not reach; and the experiment that runs
them (conf/experiment/mars_ports.yaml)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import run_config

from mars_bench.common.settings import parse_label, plugin_label
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import method_spec, shadow_verifiers
from mars_bench.verification import MarsParams, Reason, VerifyInput, batch_steps, get_verifier
from mars_bench.verification.emission import fidelity
from mars_bench.verification.mars import margin_trigger
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)
TOP1 = SamplingParams(temperature=1.0, top_k=1)  # the runner-up filtered out
PORT = {"guard": "none", "sampling": "securesd", "margin_logits": "raw"}  # SecureSD's port, theta at 0.9
LOW = -20.0


def chain(rows: list[list[float]], drafts: list[int], sampling: SamplingParams = GREEDY, **extra) -> VerifyInput:
    return VerifyInput(
        torch.tensor(drafts), torch.arange(-1, len(drafts) - 1), torch.tensor(rows, dtype=torch.float32), sampling, **extra
    )


def margin_row(z1: float, z2: float) -> list[float]:
    """Token 0 has logit z1, token 1 has z2, the other three LOW."""
    return [z1, z2, LOW, LOW, LOW]


def verdicts(name_settings: dict, step: VerifyInput, seeds=range(8)) -> set[tuple]:
    """The distinct (accepted path, next token) of ``mars`` with these settings over several generators."""
    verifier = get_verifier("mars", **name_settings)
    out = set()
    for seed in seeds:
        verdict = verifier.verify(step, generator=torch.Generator().manual_seed(seed))
        out.add((tuple(verdict.accepted.tolist()), verdict.next_token))
    return out


# --- guard=none: the ratio as written -------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE], ids=["greedy", "t1"])
def test_guard_none_relaxes_two_negative_logits_where_the_guards_do_not(sampling):
    # z1 = -1, z2 = -3: the ratio z2 / z1 = 3.0 passes theta 0.9 (and theta 1); the gap 2 is far above
    # (1 - 0.9) * |z1| = 0.1, and ``never`` does not relax at z1 <= 0. Row 1 (the bonus) is all but one-hot.
    step = chain([margin_row(-1.0, -3.0), margin_row(30.0, 0.0)], [1], sampling)
    for theta in (0.9, 1.0):
        assert verdicts({"theta": theta, "guard": "none"}, step) == {((0,), 0)}  # kept, every time
        assert verdicts({"theta": theta, "guard": "none", "sampling": "securesd"}, step) == {((0,), 0)}
    for guard, fires in (("none", True), ("never", False), ("gap", False)):
        decisions = get_verifier("mars", guard=guard).verify(step, generator=torch.Generator().manual_seed(0)).decisions
        assert decisions.statistics["trigger"].tolist() == [fires]
    # the guards leave the runner-up to the strict test: p(1) = e^-2 / (1 + e^-2 + 3 e^-19) = 0.12 (0 when greedy)
    for guard in ("never", "gap"):
        assert ((), 0) in verdicts({"guard": guard}, step, seeds=range(40))
    # positive logits: every guard is the same test
    positive = chain([margin_row(10.0, 9.5), margin_row(30.0, 0.0)], [1], sampling)
    assert verdicts({"guard": "none"}, positive) == verdicts({"guard": "never"}, positive) == {((0,), 0)}


@pytest.mark.parametrize(
    ("z1", "z2", "ratio", "relaxes"),
    [
        (0.0, 0.0, math.nan, False),  # 0 / 0: nan, and nan > theta is false
        (0.0, -1.0, -math.inf, False),  # -1 / +0.0
        (-0.0, -1.0, math.inf, True),  # -1 / -0.0 = +inf > theta: relaxes, as SecureSD's float32 division does
        (-1e-30, -1.0, 1e30, True),  # a top logit just below zero: any runner-up below it passes
    ],
)
def test_guard_none_at_a_zero_top_logit_divides_as_ieee_floats_do(z1, z2, ratio, relaxes):
    step = chain([margin_row(z1, z2), margin_row(2.0, 0.0)], [1])
    verdict = get_verifier("mars", guard="none").verify(step)
    assert verdict.accepted_len == int(relaxes) and verdict.next_token == 0
    margin = float(verdict.decisions.statistics["margin"][0])
    assert (math.isnan(margin) and math.isnan(ratio)) or margin == pytest.approx(ratio)
    assert bool(verdict.decisions.statistics["trigger"][0]) is relaxes
    one = torch.tensor([z1])
    assert margin_trigger(one, torch.tensor([z2]), 0.9, "none").tolist() == [relaxes]
    assert margin_trigger(one, torch.tensor([z2]), 0.9, "never").tolist() == [False]  # the paper's guard


# --- sampling=securesd: no coin, the argmax emitted -------------------------------------------


def port_step() -> VerifyInput:
    """Three deterministic drafts at T = 1: the top token at row 0 (p = 0.54; ratio 0.5), the runner-up at row 1
    (ratio 0.95, triggered), a rank-3 token at row 2 (ratio 0.67); row 3 is the bonus row."""
    rows = [[2.0, 1.0, 0.5, 0.0, 0.0], [4.0, 3.8, 1.0, 0.0, 0.0], [3.0, 1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.5]]
    return chain(rows, [0, 1, 1], SAMPLE, draft_probs=torch.tensor([0.9, 0.9, 0.9]))


def test_securesd_sampling_is_deterministic_at_t1_and_emits_the_argmax():
    step = port_step()
    generator = torch.Generator().manual_seed(3)
    before = generator.get_state()
    verdict = get_verifier("mars", sampling="securesd").verify(step, generator=generator)
    assert torch.equal(generator.get_state(), before)  # it draws no random number
    assert verdicts({"sampling": "securesd"}, step, seeds=range(30)) == {((0, 1), 0)}  # row 2's argmax is token 0
    assert verdict.decisions.reasons.tolist() == [Reason.EXACT, Reason.RELAXED, Reason.REJECTED]
    # the paper's sampling: the top-1 draft at row 0 is kept with probability p = 0.54 (q one-hot), the rank-3
    # draft at row 2 with p = 0.09, and the correction is a sample
    assert len(verdicts({}, step, seeds=range(30))) > 2
    full = replace(step, draft_tokens=torch.tensor([0, 1, 0]))  # every draft kept: the bonus is row 3's argmax
    assert verdicts({"sampling": "securesd"}, full, seeds=range(5)) == {((0, 1, 2), 3)}
    tree = VerifyInput(torch.tensor([1, 0]), torch.tensor([-1, -1]), step.target_logits[:3], SAMPLE)
    assert verdicts({"sampling": "securesd", "theta": 0.4}, tree) == {((1,), 0)}  # the top-1 child before a relaxed one


def test_securesd_emission_is_a_point_mass_with_deterministic_drafts_and_mixes_q_with_sampled_ones():
    step = port_step()
    verifier = get_verifier("mars", sampling="securesd")
    emission = verifier.emission(step)
    assert emission.rows.tolist() == [0, 1, 2]
    assert emission.dist.argmax(-1).tolist() == [0, 1, 0] and torch.equal(emission.dist.max(-1).values, torch.ones(3))
    assert emission.accept.tolist() == [1.0, 1.0, 0.0]
    q = torch.tensor([[0.1, 0.6, 0.2, 0.05, 0.05], [0.2, 0.5, 0.1, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
    sampled = verifier.emission(replace(step, draft_probs=None, draft_dists=q))
    # row 0 untriggered (ratio 0.5): P_V = 1{t1}; row 1 triggered: (1 - q(t2)) 1{t1} + q(t2) 1{t2}; row 2: 1{t1}
    expected = torch.zeros(3, 5)
    expected[0, 0], expected[1, 0], expected[1, 1], expected[2, 0] = 1.0, 0.5, 0.5, 1.0
    assert torch.allclose(sampled.dist, expected)
    assert torch.allclose(sampled.accept, torch.tensor([0.1, 0.7, 0.3]))  # q(t1) + g q(t2)


# --- margin_logits=raw: the runner-up before top-k and top-p ----------------------------------


def test_raw_margin_logits_relax_to_a_runner_up_that_top_k_filtered():
    # top_k = 1 leaves the processed row [5, -inf, ...]: no runner-up, no relaxation; on the raw logits the ratio
    # is 4.8 / 5 = 0.96 > 0.9 and token 1 (p = 0 after the filter) is kept
    step = chain([[5.0, 4.8, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0, 0.0]], [1], TOP1)
    assert verdicts({"sampling": "securesd"}, step) == {((), 0)}
    assert verdicts({"sampling": "securesd", "margin_logits": "raw"}, step) == {((0,), 1)}
    assert verdicts({"margin_logits": "raw"}, step) == {((0,), 1)}  # the paper's sampling keeps a triggered top-2 draft too
    verdict = get_verifier("mars", margin_logits="raw").verify(step, generator=torch.Generator())
    assert verdict.decisions.statistics["margin"].tolist() == [pytest.approx(0.96)]  # the margin of the logits the rule read
    emission = get_verifier("mars", **PORT).emission(step)
    p = probabilities(process_logits(step.target_logits, TOP1), TOP1)[emission.rows]
    assert emission.dist[0, 1] == 1.0 and fidelity(emission, p).kl[0] == math.inf  # a token the target never emits
    other = chain([[-1.0, -0.95, 2.0, -3.0, -4.0], [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]], [2, 1], TOP1)
    for settings in (PORT, {"margin_logits": "raw"}):  # a batch judges each request as it is judged alone
        verifier = get_verifier("mars", **settings)
        together = verifier.verify_batch(batch_steps([step, other]), generator=[torch.Generator().manual_seed(i) for i in (0, 1)])
        alone = [verifier.verify(one, generator=torch.Generator().manual_seed(i)) for i, one in enumerate((step, other))]
        assert [(v.accepted.tolist(), v.next_token) for v in together] == [(v.accepted.tolist(), v.next_token) for v in alone]
        for each, one in zip(verifier.emission_batch(batch_steps([step, other])), (step, other)):
            assert torch.equal(each.dist, verifier.emission(one).dist)
    unfiltered = replace(step, sampling=SAMPLE)  # without top-k or top-p the raw logits are the processed ones
    for settings in ({"sampling": "securesd"}, {}):
        raw, processed = get_verifier("mars", **settings, margin_logits="raw"), get_verifier("mars", **settings)
        assert torch.equal(raw.emission(unfiltered).dist, processed.emission(unfiltered).dist)


def empirical(settings: dict, logits: list[list[float]], q: torch.Tensor, sampling: SamplingParams, draws: int = 1500):
    """One drafted position, its draft drawn from q afresh in each of ``draws`` runs judged in one batched
    call: (the emitted tokens' counts [V], drafts kept) against ``emission``'s P_V and alpha_V at row 0."""
    generator = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q, draws, replacement=True, generator=generator)
    base = chain(logits, [0], sampling, draft_dists=q[None])
    steps = [replace(base, draft_tokens=drafts[i : i + 1], draft_probs=q[drafts[i : i + 1]]) for i in range(draws)]
    verifier = get_verifier("mars", **settings)
    counts, kept = torch.zeros(q.shape[0]), 0
    for step, verdict in zip(steps, verifier.verify_batch(batch_steps(steps), generator=generator)):
        token = int(step.draft_tokens[0]) if verdict.accepted_len else verdict.next_token
        counts[token] += 1
        kept += verdict.accepted_len
    emission = verifier.emission(base)
    return counts / draws, kept / draws, emission.dist[0], float(emission.accept[0])


CASES = {
    # z1 = -1, z2 = -1.5: ratio 1.5, triggered under guard=none only; q puts most on the runner-up
    "negative": ([[-1.0, -1.5, -2.0, -3.0, -4.0], [1.0, 0.0, 0.0, 0.0, 0.0]], [0.15, 0.5, 0.2, 0.1, 0.05], SAMPLE),
    # top_k = 1 filters the runner-up (ratio 0.96 on the raw logits)
    "filtered": ([[5.0, 4.8, 1.0, 0.0, -1.0], [1.0, 0.0, 0.0, 0.0, 0.0]], [0.3, 0.5, 0.1, 0.05, 0.05], TOP1),
}
PORT_SETTINGS = [
    ("negative", {"guard": "none"}),
    ("negative", {"guard": "never"}),
    ("negative", {"guard": "none", "sampling": "securesd"}),
    ("filtered", {"margin_logits": "raw"}),
    ("filtered", PORT),
    ("filtered", {"sampling": "securesd"}),
]


@pytest.mark.parametrize(("case", "settings"), PORT_SETTINGS, ids=[f"{case}-{s}" for case, s in PORT_SETTINGS])
def test_the_emission_is_what_the_verdicts_emit_where_the_port_settings_act(case, settings):
    logits, q, sampling = CASES[case]
    frequency, kept, dist, accept = empirical(settings, logits, torch.tensor(q), sampling)
    spread = (dist * (1 - dist) / 1500).sqrt()
    assert ((frequency - dist).abs() <= 4.5 * spread + 1e-9).all(), (frequency.tolist(), dist.tolist())
    assert abs(kept - accept) <= 4.5 * math.sqrt(accept * (1 - accept) / 1500) + 1e-9, (kept, accept)


def test_each_port_setting_changes_the_emission_on_its_case():
    """Otherwise the test above would compare a setting's emission with another's verdicts only."""
    emitted = {}
    for case, settings in PORT_SETTINGS:
        logits, q, sampling = CASES[case]
        step = chain(logits, [0], sampling, draft_dists=torch.tensor(q)[None])
        emitted[case, str(settings)] = get_verifier("mars", **settings).emission(step).dist[0]
    tv = lambda a, b: 0.5 * float((emitted[a] - emitted[b]).abs().sum())  # noqa: E731
    none, never, port = ("negative", "{'guard': 'none'}"), ("negative", "{'guard': 'never'}"), ("filtered", str(PORT))
    assert tv(none, never) > 0.1 and tv(none, ("negative", "{'guard': 'none', 'sampling': 'securesd'}")) > 0.1
    assert tv(port, ("filtered", "{'sampling': 'securesd'}")) > 0.1
    assert tv(("filtered", "{'margin_logits': 'raw'}"), ("filtered", "{'sampling': 'securesd'}")) > 0.1


# --- defaults, labels and refusals ----------------------------------------------------------------


def test_the_defaults_are_the_papers_rule_and_keep_their_labels():
    params = MarsParams()
    assert (params.guard, params.sampling, params.margin_logits, params.correction) == ("never", "paper", "processed", "residual")
    assert plugin_label("mars", params) == "mars(theta=0.9,guard=never,correction=residual)"
    port = get_verifier("mars", **PORT)
    label = "mars(theta=0.9,guard=none,correction=residual,sampling=securesd,margin_logits=raw)"
    assert plugin_label("mars", port.params) == label
    assert parse_label(label) == ("mars", {"theta": 0.9, "correction": "residual", **PORT})
    step = port_step()
    paper = get_verifier("mars", guard="never", sampling="paper", margin_logits="processed")
    for seed in range(5):
        one, other = (v.verify(step, generator=torch.Generator().manual_seed(seed)) for v in (paper, get_verifier("mars")))
        assert (one.accepted.tolist(), one.next_token) == (other.accepted.tolist(), other.next_token)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"guard": "clip"}, "^guard='clip' is invalid: allowed are never, gap, none$"),
        ({"sampling": "greedy"}, "^sampling='greedy' is invalid: allowed are paper, securesd$"),
        ({"margin_logits": "scaled"}, "^margin_logits='scaled' is invalid: allowed are processed, raw$"),
        ({"sampling": "securesd", "correction": "target"}, "^correction='target' is invalid with sampling='securesd'"),
        ({"sampling": None}, "^sampling=None is invalid"),
    ],
)
def test_bad_port_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message) as info:
        get_verifier("mars", **settings)
    assert "\n" not in str(info.value)


def test_a_bad_port_setting_in_a_shadow_or_on_the_command_line_is_refused_in_one_line():
    for overrides in (['shadow=["mars(sampling=fast)"]'], ["verifier.margin_logits=logits"]):
        with pytest.raises(ValueError, match="is invalid: allowed are") as info:
            check_run_config(run_config(*overrides))
        assert "\n" not in str(info.value)


# --- the experiment --------------------------------------------------------------------------


def test_the_ports_experiment_composes_its_grid_and_judges_every_port_on_the_live_drafts():
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mars_bench.__main__ import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        sweep = compose(config_name="config", overrides=["experiment=mars_ports"], return_hydra_config=True)
        params = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in sweep.hydra.sweeper.params.items()])
        cells = BasicSweeper.split_arguments(params, max_batch_size=None)[0]
        assert len(cells) == 12  # guard x sampling x three tasks
        grid = {tuple(sorted(cell)) for cell in cells}
        assert ("task=gsm8k", "verifier.guard=none", "verifier.sampling=securesd") in grid
        ends = (cells[0], cells[-1])  # the paper's rule, and SecureSD's port
        composed = [compose(config_name="config", overrides=["experiment=mars_ports", *cell]) for cell in ends]
    for cfg in composed:  # every check the app makes before a model loads
        check_run_config(cfg)
        assert cfg.verifier.name == "mars" and cfg.temperature == 1.0 and cfg.fidelity and cfg.task.max_turns == 1
    paper, port = (method_spec(cfg).verifier_label for cfg in composed)
    assert paper == "mars(theta=0.9,guard=never,correction=residual)"
    assert port == "mars(theta=0.9,guard=none,correction=residual,sampling=securesd)"
    shadows = shadow_verifiers(composed[0])
    assert {"rejection", paper, port, plugin_label("mars", get_verifier("mars", **PORT).params), "mars_ref(theta=0.9)"} <= set(
        shadows
    )
    assert [cfg.task.name for cfg in composed] == ["humaneval", "mt_bench"]
