"""The step profiles' shared pieces: benchmarks/step_profile_ranges.py (phases timed and split by torch.profiler)
and benchmarks/pyspy_summary.py (py-spy's folded stacks of the steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ranges = load_script(BENCHMARKS / "step_profile_ranges.py")
pyspy = load_script(BENCHMARKS / "pyspy_summary.py")


class _Loop:
    def __init__(self) -> None:
        self.weight = torch.randn(64, 32)

    def step(self) -> None:
        self.inner(torch.randn(4, 32))

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight).relu().sum()


@pytest.mark.slow  # torch.profiler's first start takes about a second
def test_a_phase_counts_only_inside_a_step_and_the_profile_splits_its_linear_layers_from_the_rest():
    clock = ranges.PhaseClock()
    loop = _Loop()
    clock.wrap(loop, "step", "step")
    clock.wrap(loop, "inner", "inner")
    loop.inner(torch.randn(4, 32))  # outside a step, like a prefill's forward: not counted
    with ranges.cpu_profile() as prof:
        for _ in range(3):
            loop.step()
        loop.inner(torch.randn(4, 32))
    timed = clock.snapshot(3)
    assert timed["step"]["calls_per_step"] == 1.0 and timed["inner"]["calls_per_step"] == 1.0
    assert 0 < timed["inner"]["ms_per_step"] <= timed["step"]["ms_per_step"]

    profile = ranges.phase_breakdown(prof, 3)
    assert set(profile) == {"step", "inner"}
    inner = profile["inner"]
    assert inner["calls"] == 1.0  # the call outside a step is left out of the trace's phases too
    assert 0 < inner["linear_ms"] <= inner["ops_ms"] <= inner["wall_ms"]
    assert inner["outside_ops_ms"] == inner["wall_ms"] - inner["ops_ms"]
    assert "aten::linear" in inner["top_ops_ms"] and "aten::relu" in inner["top_ops_ms"]
    table = ranges.markdown({"toy": profile}, ["step", "inner"])
    assert table.splitlines()[2].startswith("| toy | step | 1.00 |")


def test_a_sides_result_is_written_with_what_it_ran_on(tmp_path, capsys):
    timed = {"step": {"ms_per_step": 10.0, "calls_per_step": 1.0}}
    profile = {"step": {"calls": 1.0, "wall_ms": 11.0, "ops_ms": 9.0, "linear_ms": 8.0, "outside_ops_ms": 2.0}}
    ranges.write_result(tmp_path / "toy.json", "toy", ["step"], steps=3, timed=timed, profile=profile, tokens=12)
    written = json.loads((tmp_path / "toy.json").read_text())
    assert written["side"] == "toy" and written["steps"] == 3 and written["tokens"] == 12
    assert written["torch"] == torch.__version__ and written["threads"] == torch.get_num_threads()
    assert written["timed"] == timed and written["profile"] == profile
    assert "| toy (profiled) | step | 1.00 | 11.0 | 9.0 | 8.0 | 2.0 |" in capsys.readouterr().out


def test_a_named_phase_can_depend_on_the_phases_open_and_none_runs_untimed():
    clock = ranges.PhaseClock()
    loop = _Loop()
    clock.wrap(loop, "step", "step")
    clock.wrap(loop, "inner", lambda open_: "inner in step" if "step" in open_ else None)
    loop.inner(torch.randn(4, 32))
    loop.step()
    assert set(clock.snapshot(1)) == {"step", "inner in step"}


def test_pyspy_summary_reads_only_the_unprofiled_steps_and_names_where_their_samples_were(tmp_path):
    step = "main (spec_step_profile.py:70);_Batch.step (mars_bench/decoding/engine.py:300)"
    model = "Qwen2ForCausalLM.forward (transformers/models/qwen2/modeling_qwen2.py:400)"
    op = "OpOverloadPacket.__call__ (torch/_ops.py:1279)"
    top_two = "top_two (mars_bench/verification/kernels.py:330)"
    folded = tmp_path / "ours.folded"
    folded.write_text("\n".join([
        f"{step};ModelDrafter.propose (mars_bench/drafting/model.py:160);{model};{op} 6",
        f"{step};{model};{op} 3",
        f"{step};_Batch.judge (mars_bench/decoding/engine.py:330);{top_two} 1",
        "main (spec_step_profile.py:60);load_model (mars_bench/models/loading.py:100) 50",  # outside a step
        f"main.<locals>.<genexpr> (spec_step_profile.py:80);{step.split(';')[1]};{top_two} 9",  # the profiled pass
    ]) + "\n")  # fmt: skip
    summary = pyspy.summarise(folded, top=5)
    assert summary["step_samples"] == 10
    assert summary["phases"]["draft"] == {"samples": 6, "share_of_step": 0.6}
    assert summary["phases"]["target forward"]["samples"] == 3  # the draft model's forward is not the target's
    assert summary["phases"]["verify"]["samples"] == 1
    assert summary["innermost"][0] == {"function": "OpOverloadPacket.__call__ (torch/_ops.py)", "samples": 9, "share": 0.9}
