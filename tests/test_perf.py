"""The performance suite runs end to end on a small pair and reports every comparison, the
phase profile and the analytic model. (Its speed targets are met in the benchmark run whose
numbers docs/performance.md gives, not asserted here.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import SHARED_DATA, fake_python, python_m, tiny_model

import mars_bench.perf.suite as suite_module
from mars_bench.decoding import decode
from mars_bench.decoding.draft_length import DEFAULT_LENGTH, DraftLengthSettings
from mars_bench.drafting import drafter_for
from mars_bench.perf.__main__ import main as perf_main
from mars_bench.perf.__main__ import parse as perf_options
from mars_bench.perf.costs import ForwardTimer, calibrated_costs, capped_step_speedups, predicted_step_speedup
from mars_bench.perf.report import header as report_header
from mars_bench.perf.report import main as report_main
from mars_bench.perf.report import policy_keys, predicted_decode_tok_s, task_ratios
from mars_bench.perf.suite import DraftConfig, PerfSettings, first_turn_prompts, task_prompts

SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_bad_options_are_one_clear_line(tmp_path):
    result = python_m("mars_bench.perf", "--model", "nope", "--out", str(tmp_path))
    assert result.returncode == 2 and "perf: error: --model 'nope' is unknown: allowed are" in result.stderr
    assert "Traceback" not in result.stderr
    counts = tmp_path / "counts.txt"
    counts.write_text("1 2 3")
    result = python_m("mars_bench.perf", "--draft-vocab", "32768", "--token-counts", str(counts), "--out", str(tmp_path))
    assert result.returncode == 2 and "has suffix '.txt': allowed are .npy and .json" in result.stderr
    assert "Traceback" not in result.stderr and "Loading weights" not in result.stderr  # refused before any model loads


@pytest.mark.parametrize(("options", "error"), [
    (["--configs", "fixed", "--draft-vocab", "32768"], "--configs replaces --draft-length and --draft-vocab: allowed is one"),
    (["--configs", "fixed:lots"], "--configs fixed:lots is invalid: allowed as a vocabulary are none and integers >= 1"),
    (["--configs", "confidence:32768", "confidence:32768"], "--configs confidence:32768 is given twice: allowed is each"),
    (["--configs", "fixed", "eager"], "'eager' is invalid: allowed are fixed"),
    (["--configs", "fixed:32768:int2"], "--configs fixed:32768:int2 is invalid: allowed as weights are int8, int4"),
    (["--configs", "fixed:none:int4:x"], "--configs fixed:none:int4:x is invalid: allowed as guesses are integers >= 0"),
    (["--configs", "fixed:none:int4:2:x"], "--configs fixed:none:int4:2:x is invalid: allowed as guesses are integers >= 0"),
    (["--configs", "fixed:32768+chat"], "--configs fixed:32768+chat is invalid: allowed after K+ is context"),
    (["--configs", "fixed:none+context"], "drafter.context_vocab=true adds the context's tokens to drafter.draft_vocab"),
    (["--peers", "sglang"], "--peers sglang is invalid: allowed are generate, assisted, assisted-like, vllm, vllm-spec"),
    (["--peers", "vllm-spec", "--temperatures", "1"], "--peers vllm-spec is timed greedy only: allowed with it are"),
    (["--min-confidence", "1.5"], "drafter.min_confidence=1.5 is invalid: allowed is a number in (0, 1)"),
    (["--draft-cost", "0"], "drafter.draft_cost=0.0 is invalid: allowed is a number > 0"),
    (["--configs", "schedule", "--gamma", "20"], "drafter.max_gamma=16 is invalid: allowed is an integer >= gamma (20)"),
    (["--vllm-gamma", "0"], "--vllm-gamma=0 is invalid: allowed is an integer >= 1 (omitted: --gamma)"),
    (["--vllm-gamma", "7"], "--vllm-gamma=7 is for vLLM's speculation: allowed with --peers vllm-spec"),
])  # fmt: skip
def test_configurations_given_one_by_one_are_checked_before_anything_loads(options, error, tmp_path, capsys):
    assert perf_main([*options, "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert message.startswith("perf: error: ") and error in message and len(message.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_configurations_given_one_by_one_replace_every_length_with_every_vocabulary():
    settings, _ = perf_options(["--configs", "fixed", "confidence:32768"])
    assert settings.configs() == [DraftConfig.of("model", "fixed"), DraftConfig.of("model", "confidence", draft_vocab=32768)]
    quantized, _ = perf_options(["--configs", "confidence:32768", "confidence:32768:int4", "fixed:none:int8"])
    assert quantized.configs()[1:] == [DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4"),
                                       DraftConfig.of("model", "fixed", weights="int8")]  # fmt: skip
    names = ["confidence + vocab 32768 + int4 weights", "fixed + int8 weights"]
    assert [config.name for config in quantized.configs()[1:]] == names
    assert [config.drafter_key for config in quantized.configs()] == ["32768", "32768:int4", "None:int8"]
    guessing, _ = perf_options(["--configs", "confidence:32768:int4:3", "confidence:32768:none:3"])
    assert guessing.configs() == [DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4", guesses=3),
                                  DraftConfig.of("model", "confidence", draft_vocab=32768, guesses=3)]  # fmt: skip
    assert guessing.configs()[0].name == "confidence + vocab 32768 + int4 weights + 3 guesses"
    prompted, _ = perf_options(["--configs", "confidence:32768+context:int4:3"])
    assert prompted.configs() == [DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4", guesses=3,
                                                 context_vocab=True)]  # fmt: skip
    assert prompted.configs()[0].name == "confidence + vocab 32768 + context tokens + int4 weights + 3 guesses"
    assert prompted.configs()[0].drafter_key == "32768+context:int4"
    assert prompted.spec(prompted.configs()[0], 0.0).drafter_settings.context_vocab
    gaining, _ = perf_options(["--configs", "gain:32768:int4:3", "schedule", "--draft-cost", "0.2", "--gamma", "8",
                               "--max-gamma", "24"])  # fmt: skip
    assert [gaining.spec(config, 0.0).length for config in gaining.configs()] == [
        DraftLengthSettings("gain", 8, 24, DEFAULT_LENGTH.min_confidence, 0.2),
        DraftLengthSettings("schedule", 8, 24, DEFAULT_LENGTH.min_confidence, 0.2)]  # fmt: skip
    product, _ = perf_options(["--draft-length", "fixed", "confidence", "--draft-vocab", "none", "32768"])
    assert len(product.configs()) == 4 and set(settings.configs()) < set(product.configs())


def test_skipped_prompts_are_each_tasks_first_and_the_report_names_the_range(monkeypatch):
    monkeypatch.setattr(suite_module, "chat_prompt_ids", lambda tokenizer, turns, system: turns[0])  # the question text
    settings = PerfSettings(target=SMOLLM, draft_model=SMOLLM, tasks=("gsm8k", "mt_bench"), num_prompts=2, skip_prompts=3,
                            data_dir=str(SHARED_DATA))  # fmt: skip
    unseen = task_prompts(None, settings)
    first = {task: first_turn_prompts(None, task, 5, str(SHARED_DATA)) for task in settings.tasks}
    assert unseen == [(task, text) for task in settings.tasks for text in first[task][3:5]]
    with pytest.raises(ValueError, match="--skip-prompts=-1 is invalid: allowed is an integer >= 0"):
        perf_options(["--skip-prompts", "-1"])
    result = {"settings": {**dataclasses.asdict(settings), "configurations": [{"length": "gain", "vocab": None}]}, "prompts": 4,
              "repeats_done": 2, "peer_loading": "from_pretrained", "assisted_generation": {}}  # fmt: skip
    assert "4 prompts (gsm8k, mt_bench; each task's prompts 4 to 5)" in report_header(result)


def test_the_report_header_names_the_keys_its_draft_length_policies_read():
    keys = {"max_gamma": 24, "min_confidence": 0.6, "draft_cost": 0.15}
    gain_and_fixed = {**keys, "configurations": [{"length": "gain"}, {"length": "fixed"}], "draft_lengths": []}
    assert policy_keys(gain_and_fixed) == ", draft cost 0.15 target forwards"
    assert policy_keys({**keys, "draft_lengths": ["schedule", "confidence"]}) == ", max gamma 24, stop at q < 0.6"
    assert policy_keys({"draft_lengths": ["confidence"]}) == ""  # a report written before the keys were recorded


def two_task_report(**extra):
    """A report's raw times: 2 repeats of 2 humaneval then 1 gsm8k prompt, for a method and its baseline."""
    fast = [[{"tokens": 10, "seconds": 1.0}, {"tokens": 10, "seconds": 1.0}, {"tokens": 10, "seconds": 4.0}]] * 2
    slow = [[{"tokens": 10, "seconds": 2.0}, {"tokens": 10, "seconds": 2.0}, {"tokens": 10, "seconds": 2.0}]] * 2
    return {"raw": {"spec": fast, "ar": slow}, "prompts": 3, **extra}


def test_speedups_are_split_by_task_from_the_raw_times():
    report = two_task_report(prompt_tasks=["humaneval", "humaneval", "gsm8k"])
    assert task_ratios(report, "spec", "ar") == {"humaneval": 2.0, "gsm8k": 0.5}
    # reports from before prompt_tasks took num_prompts from each task in turn
    assert task_ratios(two_task_report(settings={"tasks": ["humaneval"], "num_prompts": 3}), "spec", "ar") == {"humaneval": 1.0}
    old = two_task_report(settings={"tasks": ["humaneval", "gsm8k"], "num_prompts": 1})
    with pytest.raises(ValueError, match="the report has 3 prompts and no prompt_tasks"):
        task_ratios(old, "spec", "ar")


def test_re_rendering_a_report_refuses_what_is_not_one(tmp_path, capsys):
    broken = tmp_path / "perf.json"
    broken.write_text("{}")
    assert report_main([str(broken)]) == 2 and report_main([str(tmp_path / "none.json")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[0].startswith(f"perf.report: error: {broken} is not a perf suite report (KeyError")
    assert errors[1].endswith("none.json given: allowed is the path of one perf.json")


def test_each_cap_on_the_drafts_cuts_the_steps_taken_and_the_best_is_where_tokens_per_second_peak():
    target_s = {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.2}  # a target forward doubles past 3 tokens
    steps = [(3, 3, 4), (3, 1, 2), (1, 0, 1)]  # (drafted, accepted, emitted)
    speedups = capped_step_speedups(steps, target_s, 0.01)
    assert list(speedups) == [1, 2, 3]  # up to the deepest draft made
    assert speedups[1] == pytest.approx((2 + 2 + 1) * 0.1 / (3 * (0.01 + 0.1)))
    assert speedups[2] == pytest.approx((3 + 2 + 1) * 0.1 / (2 * (0.02 + 0.1) + 0.01 + 0.1))
    assert speedups[3] == pytest.approx(predicted_step_speedup(4 + 2 + 1, [3, 3, 1], target_s, 0.01))  # the decode's own cap
    assert max(speedups, key=speedups.get) == 2  # the doubled forward at 4 tokens outweighs the third draft's gain
    assert capped_step_speedups([(3, 3, 2)], target_s, 0.01)[3] == pytest.approx(2 * 0.1 / (0.03 + 0.2))  # a cut last step
    assert capped_step_speedups([(5, 5, 6)], {1: 0.1, 2: 0.1, 3: 0.1}, 0.01).keys() == {1, 2}  # no cap past the widths timed


def test_the_analytic_model_is_tokens_over_the_forward_cost_of_the_steps_taken():
    target_s = {1: 0.1, 2: 0.104, 3: 0.108, 5: 0.12}
    # two steps of 4 drafts (0.05 s each) and a 0.12 s verify, 8 tokens: 0.8 s of AR work in 0.64 s
    assert predicted_step_speedup(8, [4, 4], target_s, 0.05) == pytest.approx(1.25)
    assert predicted_step_speedup(3, [0, 0, 0], target_s, 0.05) == pytest.approx(1.0)  # drafting nothing is the baseline
    # adaptive lengths: each step pays for its own drafts and its own verify width
    assert predicted_step_speedup(5, [1, 2], target_s, 0.05) == pytest.approx(0.5 / (0.05 + 0.104 + 0.1 + 0.108))


def test_the_chain_is_also_held_to_the_decode_throughput_its_forward_costs_predict_without_an_ar_side():
    # a predicted 2x over an AR side of one 0.25 s forward per token: the chain's forwards allow 8 tokens/s
    old_row = {"predicted": 2.0}  # a report written before calibration: its AR side is the isolated one-token forward
    assert predicted_decode_tok_s(old_row, {"target": {"1": 0.25, "2": 0.2}}) == pytest.approx(8.0)  # as read from perf.json
    assert predicted_decode_tok_s(old_row, {"target": {1: 0.25, 2: 0.2}}) == pytest.approx(8.0)  # as the suite builds it
    calibrated = {"predicted": 2.0, "one_token_s": 0.2}  # priced at the AR decodes' own one-token forward
    assert predicted_decode_tok_s(calibrated, {"target": {1: 0.25}}) == pytest.approx(10.0)


def test_the_calibrated_costs_take_each_widths_median_and_a_line_through_them():
    forwards = [(1, 0.10), (1, 0.10), (1, 0.50), (3, 0.14), (3, 0.14), (3, 0.14)]  # an outlier at width 1 moves no median
    costs = calibrated_costs(forwards, [1, 2, 3, 5])
    assert costs == pytest.approx({1: 0.10, 2: 0.12, 3: 0.14, 5: 0.18})
    assert calibrated_costs([(1, 0.2), (1, 0.3), (1, 0.4)], [1, 4]) == {1: 0.3, 4: 0.3}  # one width fed: its median
    with pytest.raises(ValueError, match="no forwards"):
        calibrated_costs([], [1])


def test_the_forward_timer_counts_every_forward_of_both_models_inside_its_block_only():
    target, draft = tiny_model(seed=0), tiny_model(seed=1)
    drafter = drafter_for("model", target, draft)
    with ForwardTimer(target, draft) as timer:
        result = decode(target, drafter, "exact", [1, 2, 3], max_new_tokens=12, gamma=3)
    # Per step: one target forward and one drafter forward per draft; plus both prefills.
    assert timer.calls == 2 + result.verify_steps + result.drafted
    assert 0 < timer.seconds < result.prefill_s + result.decode_s
    assert len(timer.forwards) == timer.calls and sum(seconds for _, seconds in timer.forwards) == pytest.approx(timer.seconds)
    widths = sorted(width for width, _ in timer.forwards)  # tokens fed: the prefills, verify widths, draft feeds
    assert widths.count(3) >= 1 and sum(width == 4 for width in widths) == sum(s.drafted == 3 for s in result.steps)
    target(torch.tensor([[1, 2]]))  # outside the block: not counted
    assert timer.calls == 2 + result.verify_steps + result.drafted


def speed_settings(model) -> dict:
    """What about a loaded model can change how fast transformers runs it."""
    return {
        "training": sorted({module.training for module in model.modules()}),
        "requires_grad": sorted({parameter.requires_grad for parameter in model.parameters()}),
        "dtypes": sorted({str(parameter.dtype) for parameter in model.parameters()}),
        "devices": sorted({str(parameter.device) for parameter in model.parameters()}),
        "contiguous": all(parameter.is_contiguous() for parameter in model.parameters()),
        "attention": model.config._attn_implementation,
        "config": model.config.to_dict(),
        "generation_config": model.generation_config.to_dict(),
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        "class": type(model).__name__,
    }


@pytest.mark.slow
def test_the_peers_models_are_loaded_exactly_as_a_transformers_user_loads_them():
    from transformers import AutoModelForCausalLM

    from mars_bench.models.sources import resolve_model
    from mars_bench.perf.suite import PerfSettings, Suite

    settings = PerfSettings(target=SMOLLM, draft_model=SMOLLM, tasks=("gsm8k",), num_prompts=1, data_dir=str(SHARED_DATA))
    suite = Suite(settings)
    plain = AutoModelForCausalLM.from_pretrained(resolve_model(SMOLLM).path, dtype=torch.bfloat16).eval()
    assert speed_settings(suite.peer_target) == speed_settings(plain)
    assert speed_settings(suite.peer_draft) == speed_settings(plain)
    assert suite.peer_target is not suite.target.model and suite.peer_draft is not suite.draft.model
    # The control: our loader's models differ from a plain load (gradients off), hence the peer's own load.
    assert speed_settings(suite.target.model)["requires_grad"] == [False] != speed_settings(plain)["requires_grad"]


def int4_weights(model) -> dict:
    """Module name -> its packed int4 weight (torchao's: ``qdata``, ``scale_and_zero``)."""
    return {name: module.weight for name, module in model.named_modules() if hasattr(getattr(module, "weight", None), "qdata")}


@pytest.mark.slow
def test_assisted_generation_drafts_with_the_same_int4_weights_as_the_drafter_it_is_compared_with():
    from mars_bench.perf.suite import DraftConfig, PerfSettings, Suite, methods_for

    config = DraftConfig.of("model", "fixed", weights="int4")
    settings = PerfSettings(target=SMOLLM, draft_model=SMOLLM, tasks=("gsm8k",), num_prompts=1, data_dir=str(SHARED_DATA),
                            configurations=(config,), temperatures=(0.0,))  # fmt: skip
    suite = Suite(settings)
    assert {m.assistant_weights for m in methods_for(settings) if m.assisted} == {None, "int4"}
    assistant, drafter = suite.assistants["int4"], suite.drafter_module(config)
    assert suite.assistants[None] is suite.peer_draft  # the plain load stays as loaded
    quantized, ours = int4_weights(assistant), int4_weights(drafter)
    assert quantized.keys() == ours.keys() and len(quantized) == 1 + 7 * assistant.config.num_hidden_layers  # head too
    for name, weight in quantized.items():  # the same packed int4 weights, scales and zero points
        assert torch.equal(weight.qdata, ours[name].qdata) and torch.equal(weight.scale_and_zero, ours[name].scale_and_zero), name
    assert speed_settings(assistant)["attention"] == speed_settings(suite.peer_draft)["attention"]


def test_a_comparison_with_transformers_names_our_packed_linears_and_one_inside_our_engine_does_not():
    config = DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4")
    ours, ar = suite_module.Method(suite_module.OURS, 0.0, config), suite_module.Method(suite_module.OURS, 0.0)
    assisted = suite_module.Method(suite_module.PEER, 0.0, assisted=True, assistant_weights="int4")
    kernels = "the linear layers: ours packed for oneDNN"
    assert kernels in suite_module.differences(ours, assisted, packed=True)
    assert kernels in suite_module.differences(ar, suite_module.Method(suite_module.PEER, 0.0), packed=True)
    assert kernels not in suite_module.differences(ours, ar, packed=True)
    assert kernels not in suite_module.differences(ours, assisted, packed=False)
    assert suite_module.differences(ours, assisted).startswith("the decoder: ours")


def test_vllms_peers_without_the_tested_vllm_are_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    assert perf_main(["--peers", "generate", "vllm", "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert message.startswith("perf: error: --peers vllm needs vLLM, which ") and len(message.splitlines()) == 1
    assert "install it with `python -m mars_bench.serving.install`" in message
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(fake_python(tmp_path, "0.31.0")))
    assert perf_main(["--peers", "vllm", "vllm-spec", "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert message.startswith("perf: error: vLLM 0.31.0 is not supported: backend=vllm supports vLLM 0.32.0 to 0.34.0")
    assert message.rstrip().endswith("; --peers vllm vllm-spec)") and len(message.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_vllms_peers_are_timed_greedy_and_compared_with_ours_naming_what_differs():
    configs = (DraftConfig.of("model", "fixed"), DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4"))
    settings = PerfSettings(target=SMOLLM, draft_model=SMOLLM, peers=("vllm", "vllm-spec"), configurations=configs)
    methods = suite_module.methods_for(settings)
    ar, spec = "T=0 vllm AR", "T=0 vllm draft-model speculative decoding"
    assert [m.name for m in methods if m.side == suite_module.VLLM] == [ar, spec]  # greedy only, at T=0 and T=1 alike
    raw = {m.name: [[{"tokens": [1, 2, 3], "seconds": 1.0}]] for m in methods}
    rows = {(row["method"], row["against"]): row["differs"] for row in suite_module.comparisons(methods, raw, True, 5)}
    assert rows[("T=0 ours AR baseline", ar)].startswith("the engine: ours against vLLM's CPU engine (enforce_eager=True")
    assert rows[("T=0 ours AR baseline", ar)].endswith("; the linear layers: ours packed for oneDNN (model.kernels), "
                                                        "vLLM's its own (oneDNN, prepacked at load)")  # fmt: skip
    assert rows[(spec, ar)].startswith("vLLM's draft-model speculative decoding (5 drafts a step, its own rule) against none")
    like = rows[("T=0 ours chain exact, fixed", spec)]
    assert "the decoder: ours (draft length fixed) against vLLM's (5 drafts every step)" in like and "draft weights" not in like
    unlike = rows[("T=0 ours chain exact, confidence + vocab 32768 + int4 weights", spec)]
    assert "the draft weights: ours int4, vLLM's as loaded (no counterpart)" in unlike and "32,768 tokens" in unlike
    assert ("T=1 ours AR baseline", ar) not in rows


def test_a_run_whose_target_found_no_room_for_its_packed_copy_says_so_in_what_differs():
    from types import SimpleNamespace

    both, neither = SimpleNamespace(packed=object()), SimpleNamespace(packed=None)
    assert suite_module.our_linears({"target": both, "draft_model": both}) is True
    assert suite_module.our_linears({"target": neither, "draft_model": neither}) is False
    mixed = suite_module.our_linears({"target": neither, "draft_model": both})
    assert mixed == "ours packed for oneDNN for the draft model but as loaded for the target (no room for its packed copy)"
    ar, vllm_ar = suite_module.Method(suite_module.OURS, 0.0), suite_module.Method(suite_module.VLLM, 0.0)
    assert f"the linear layers: {mixed}, vLLM's its own" in suite_module.differences(ar, vllm_ar, mixed)


def test_vllms_draft_count_is_ours_unless_given_apart(tmp_path, monkeypatch):
    """Our tuned drafter against vLLM's best draft count: --vllm-gamma sets vLLM's alone, and its comparison names it."""
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(fake_python(tmp_path, "0.32.0")))  # a Python that has vLLM: none runs
    same, _ = perf_options(["--gamma", "20", "--peers", "vllm-spec", "--temperatures", "0"])
    apart, _ = perf_options(["--gamma", "20", "--vllm-gamma", "7", "--peers", "vllm-spec", "--temperatures", "0"])
    assert (same.gamma, same.peer_gamma) == (20, 20) and (apart.gamma, apart.peer_gamma) == (20, 7)
    methods = suite_module.methods_for(apart)
    raw = {m.name: [[{"tokens": [1, 2, 3], "seconds": 1.0}]] for m in methods}
    rows = suite_module.comparisons(methods, raw, True, apart.peer_gamma)
    assert any("against vLLM's (7 drafts every step)" in row["differs"] for row in rows)


def test_reports_written_before_the_drafters_own_settings_were_recorded_read_as_they_did():
    """perf.json's version 2 records a configuration as its policy and its drafter's own settings by name; a committed
    report of version 1 (its own names for them) still renders its committed perf.md, and the same run recorded as
    version 2 renders the same header."""
    import json

    from mars_bench.perf.report import REPORT_VERSION, markdown

    folder = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "perf_context_t0_cpu"
    old = json.loads((folder / "perf.json").read_text())
    assert "version" not in old and markdown(old).strip() == (folder / "perf.md").read_text().strip()
    names = {"vocab": "draft_vocab", "weights": "weights", "guesses": "guesses", "context_vocab": "context_vocab"}
    configurations = [{"length": c["length"], "settings": {names[k]: v for k, v in c.items() if k in names}}
                      for c in old["settings"]["configurations"]]  # fmt: skip
    new = {**old, "version": REPORT_VERSION, "settings": {**old["settings"], "configurations": configurations}}
    assert report_header(new) == report_header(old)
    assert "drafter configurations confidence + vocab 32768 + context tokens + int4 weights + 3 guesses" in report_header(new)
