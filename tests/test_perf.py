"""The performance suite runs end to end on a small pair and reports every comparison, the
phase profile and the analytic model. (Its speed targets are met in the benchmark run whose
numbers the README gives, not asserted here.)"""

from __future__ import annotations

import pytest
import torch
from conftest import python_m, tiny_model

from mars_bench.decoding import decode
from mars_bench.drafting import drafter_for
from mars_bench.perf.costs import ForwardTimer, predicted_speedup

SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_bad_options_are_one_clear_line(tmp_path):
    result = python_m("mars_bench.perf", "--model", "nope", "--out", str(tmp_path))
    assert result.returncode == 2 and "perf: error: --model 'nope' is unknown: allowed are" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_analytic_model_is_tokens_per_step_over_step_cost():
    # tau 4 tokens per step; a step costs 4 drafter forwards (0.05 s) and one 0.12 s verify; AR: 0.1 s a token
    assert predicted_speedup(4.0, 4.0, 0.1, 0.12, 0.05) == pytest.approx(1.25)  # 0.4 s of AR work in a 0.32 s step
    assert predicted_speedup(1.0, 0.0, 0.1, 0.1, 0.05) == pytest.approx(1.0)  # drafting nothing is the baseline


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
