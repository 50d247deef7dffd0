"""``backend=vllm``'s memory plan (``backends/vllm_memory.py``): its decisions from the figures (together, one
after the other, refused in one line, a GPU not planned), the figures read from a checkpoint, and what the
kernel's log says of a worker the OOM killer killed."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from mars_bench.backends.vllm_memory import (
    GIB,
    EngineFigures,
    MemoryFigures,
    OomWitness,
    kv_space,
    parameter_count,
    plan_memory,
    weight_bytes,
    worker_overhead,
)


def figures(*needs: tuple[str, float], available: float, dtype: str = "float32", on_cpu: bool = True) -> MemoryFigures:
    """Engines of ``(label, weights GiB)`` with 4 GiB of KV space and the worker's share for its weights each
    (``worker_overhead``); ``available`` GiB free, 1 GiB of them kept for the harness."""
    engines = tuple(EngineFigures(label, int(weights * GIB), 4 * GIB, worker_overhead(int(weights * GIB)))
                    for label, weights in needs)  # fmt: skip
    return MemoryFigures(engines, int(available * GIB), GIB, dtype, on_cpu)


# The embedded pair in fp32 (the target 6.6 GiB; with the 0.5B draft model 9.0 GiB), as this machine reads them.
PAIR = (("baseline", 6.6), ("mars", 9.0))


def test_engines_that_fit_side_by_side_run_together():
    plan = plan_memory(figures(*PAIR, available=34.0))
    assert plan.together
    assert plan.line == ("vLLM memory: the engines need baseline 14.2 GiB + mars 17.6 GiB = 31.8 GiB, within the "
                         "33.0 GiB available: they run together")  # fmt: skip


def test_engines_that_fit_only_alone_run_one_after_the_other_the_baseline_first():
    """A 24 GB machine with about 22 GiB available: the pair in fp32 needs 31.8 GiB together."""
    plan = plan_memory(figures(*PAIR, available=22.0))
    assert not plan.together
    assert plan.line == ("vLLM memory: the engines need baseline 14.2 GiB + mars 17.6 GiB = 31.8 GiB, more than the "
                         "21.0 GiB available: they run one after the other, the baseline engine's rows first")  # fmt: skip


def test_an_engine_that_cannot_fit_even_alone_is_refused_in_one_line_naming_its_figures():
    with pytest.raises(ValueError) as raised:
        plan_memory(figures(*PAIR, available=17.0))
    message = str(raised.value)
    assert "\n" not in message
    assert message == ("vLLM's mars engine needs 17.6 GiB of memory (weights 9.0 GiB in float32, KV space 4.0 GiB, the "
                       "worker 4.6 GiB), more than the 16.0 GiB available (17.0 GiB free less 1.0 GiB for this process): "
                       "allowed is an engine that fits (model.dtype=bfloat16 halves the weights, a smaller "
                       "VLLM_CPU_KVCACHE_SPACE shrinks the KV space)")  # fmt: skip
    with pytest.raises(ValueError, match=r"^vLLM's mars engine needs 11\.3 GiB .* \(a smaller VLLM_CPU_KVCACHE_SPACE"):
        plan_memory(figures(("baseline", 3.3), ("mars", 4.5), available=8.0, dtype="bfloat16"))  # no dtype to halve


def test_one_engine_alone_is_together_when_it_fits():
    assert plan_memory(figures(("mars", 9.0), available=19.0)).together  # accuracy_only: the method alone
    with pytest.raises(ValueError, match=r"^vLLM's mars engine needs 17\.6 GiB"):
        plan_memory(figures(("mars", 9.0), available=17.0))


def test_on_a_gpu_host_memory_is_not_planned_and_the_engines_take_turns():
    """No refusal whatever the host has (vLLM's engines live in the GPU's memory there), and two engines do not
    share one GPU: each reserves vLLM's gpu_memory_utilization of it."""
    plan = plan_memory(figures(*PAIR, available=0.5, on_cpu=False))
    assert not plan.together
    assert "vLLM runs on a GPU, so host memory is not planned" in plan.line and "one after the other" in plan.line
    assert plan_memory(figures(("mars", 9.0), available=0.5, on_cpu=False)).together


def test_weights_are_counted_from_the_checkpoints_shapes_at_the_runs_dtype(tmp_path):
    """An fp32 checkpoint of 1,000 + 24 parameters weighs 2 bytes each in bfloat16; a tied head counts once."""
    save_file({"model.embed_tokens.weight": torch.zeros(100, 10), "layer.weight": torch.zeros(4, 6),
               "lm_head.weight": torch.zeros(100, 10)}, tmp_path / "model.safetensors")  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert parameter_count(tmp_path) == 2024
    assert weight_bytes([tmp_path], "bfloat16") == 2024 * 2 and weight_bytes([tmp_path, tmp_path], "float32") == 2024 * 8
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert parameter_count(tmp_path) == 1024
    with pytest.raises(ValueError, match="^model.dtype=int8 is invalid: allowed are float32, bfloat16, float16$"):
        weight_bytes([tmp_path], "int8")


def test_the_kv_space_is_whole_gib_as_vllm_reads_it():
    assert kv_space("4") == 4 * GIB
    for bad in ("1.5", "0", "", "four"):
        with pytest.raises(ValueError, match=rf"^VLLM_CPU_KVCACHE_SPACE={re.escape(bad)} is invalid: allowed is a whole "):
            kv_space(bad)


KILL = "[ 812.5] Out of memory: Killed process {pid} (python) total-vm:19034112kB, anon-rss:18001200kB"
OURS, OTHER = frozenset({KILL.format(pid=4242)}), frozenset({KILL.format(pid=17)})


@pytest.mark.parametrize(
    ("before", "after", "verdict"),
    [
        (OomWitness(frozenset(), 0), OomWitness(OURS, 1), "^the kernel log shows the OOM killer killed it: out of memory$"),
        (OomWitness(frozenset(), None), OomWitness(OTHER, None), "killed a process meanwhile, most likely this one"),
        (OomWitness(OURS, 1), OomWitness(OURS, 1), "^the kernel log shows no OOM kill$"),
        (OomWitness(None, 0), OomWitness(None, 1), "^the memory cgroup's OOM killer killed a process meanwhile"),
        (OomWitness(None, None), OomWitness(None, None), "^the kernel log could not be read"),
    ],
)
def test_the_oom_verdict_reads_the_kill_lines_and_the_cgroups_count_since_the_worker_started(before, after, verdict):
    """Only what the kernel logged after the worker started counts (an earlier kill of the same pid does not)."""
    assert re.search(verdict, before.verdict(after, 4242))


def test_reading_the_kernel_never_fails():
    witness = OomWitness.now()
    assert witness.kill_lines is None or isinstance(witness.kill_lines, frozenset)
    assert isinstance(witness.verdict(OomWitness.now(), 1), str)
