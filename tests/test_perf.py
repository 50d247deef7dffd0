"""The performance suite runs end to end on a small pair and reports every comparison, the
phase profile and the analytic model. (Its speed targets are met in the benchmark run whose
numbers the README gives, not asserted here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import SHARED_DATA, tiny_model

from mars_bench.decoding import decode
from mars_bench.drafting import drafter_for
from mars_bench.perf.costs import ForwardTimer, predicted_speedup
from mars_bench.perf.suite import COMPARISONS

SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_suite_compares_every_method_with_transformers(tmp_path):
    command = [sys.executable, "-m", "mars_bench.perf", "--model", "smollm2-135m", "--draft-model", SMOLLM,
               "--tasks", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "2",
               "--data-dir", str(SHARED_DATA), "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "perf.json").read_text())
    assert report["repeats_done"] == 2 and not list(tmp_path.glob("*.partial"))  # rewritten whole after each repeat
    assert report["environment"]["packages"]["transformers"] and "commit" in report["environment"]["git"]
    assert len(report["environment"]["source_sha256"]) == 64
    assert list(report["results"]) == [c.name for c in COMPARISONS]
    for row in report["results"].values():
        assert len(row["ratios"]) == 2 and row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        assert row["prompt_ratio_min"] <= row["prompt_ratio_median"] <= row["prompt_ratio_max"]
        assert 0 < row["outside_forwards_share"] < 1
        assert row["runs"] == 4 and abs(sum(row["phase_share"].values()) - 1) < 1e-6
    greedy = report["results"][COMPARISONS[0].name]
    assert greedy["identical"] == 4  # our greedy AR decoding is generate's, token for token (SmolLM2, bf16)
    assert report["assisted_generation"]["num_assistant_tokens"] == 20
    assert set(report["analytic"]["speedup_over_our_baseline"]) == {c.name for c in COMPARISONS[1:]}
    assert "| AR baseline vs generate (greedy) |" in (tmp_path / "perf.md").read_text()


def test_bad_options_are_one_clear_line(tmp_path):
    command = [sys.executable, "-m", "mars_bench.perf", "--model", "nope", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "perf: error: --model 'nope' is unknown: allowed are" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_analytic_model_is_tokens_per_step_over_step_cost():
    # tau 4 tokens per step; a step costs 4 drafter forwards (0.05 s) and one 0.12 s verify; AR: 0.1 s a token
    assert predicted_speedup(4.0, 4.0, 0.1, 0.12, 0.05) == 4 * 0.1 / (4 * 0.05 + 0.12)


def test_the_forward_timer_counts_every_forward_of_both_models_inside_its_block_only():
    target, draft = tiny_model(seed=0), tiny_model(seed=1)
    drafter = drafter_for("model", target, draft)
    with ForwardTimer(target, draft) as timer:
        result = decode(target, drafter, "exact", [1, 2, 3], max_new_tokens=12, gamma=3)
    # Per step: one target forward and one drafter forward per draft; plus both prefills.
    assert timer.calls == 2 + result.verify_steps + result.drafted
    assert 0 < timer.seconds < result.prefill_s + result.decode_s
    target(torch.tensor([[1, 2]]))  # outside the block: not counted
    assert timer.calls == 2 + result.verify_steps + result.drafted
