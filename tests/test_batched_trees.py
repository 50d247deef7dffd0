"""Trees in the one engine at batch_size > 1: ``model_tree`` and ``eagle3`` decode B prompts of different lengths
together, each row with its own tree, mask and (for EAGLE-3) target features, and give each prompt what ``decode``
gives it alone: token for token in fp32 greedy decoding, and the same samples under ``rejection`` with the same
per-prompt seeds. Per-row draft lengths, shadows and fidelity survive; a step reads the device twice at any B (the
rows' trees in one transfer, their verdicts in another). And every B is timed by the one clock (``Clock``)."""

from __future__ import annotations

import pytest
import torch
from conftest import HostSyncs, OnDevice, mixed_prompts, tiny_model

from mars_bench import build_drafter, decode
from mars_bench.decoding import engine
from mars_bench.decoding.batched import _Batch, decode_batch
from mars_bench.decoding.clock import Clock
from mars_bench.decoding.draft_length import AcceptanceSchedule
from mars_bench.drafting.eagle3 import Eagle3Drafter, Eagle3Settings, eagle3_head_from_state, random_head_state
from mars_bench.drafting.tree import GrowingTrees

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0, layers=4, vocab=96)


def eagle3(target, top_k: int = 4, tree_tokens: int = 12) -> Eagle3Drafter:
    """An EAGLE-3 drafter with a random head for ``target`` (as tests/test_tree_device.py builds it)."""
    config = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "vocab_size": 96, "draft_vocab_size": 40, "rms_norm_eps": 1e-5}  # fmt: skip
    head = eagle3_head_from_state(config, random_head_state(config, 0), target, dtype=torch.float32, device="cpu")
    return Eagle3Drafter(target, head, Eagle3Settings(top_k, tree_tokens))


def tree_drafter(name: str, tiny):
    """``model_tree`` over a draft model that agrees with the target only part of the time, or ``eagle3``."""
    if name == "eagle3":
        return eagle3(tiny)
    return build_drafter("model_tree", model=tiny_model("llama", seed=7, layers=2), vocab_size=96, top_k=3, tree_tokens=10)


def in_batches(target, drafter, verifier, prompts, size, **settings):
    """``prompts`` decoded ``size`` at a time, each with its index as its seed; the results in order."""
    return [result for start in range(0, len(prompts), size)
            for result in decode_batch(target, drafter, verifier, prompts[start : start + size],
                                       seeds=range(start, min(start + size, len(prompts))), **settings)]  # fmt: skip


@pytest.mark.slow  # over a second each
@pytest.mark.parametrize("name", ["model_tree", "eagle3"])
@pytest.mark.parametrize(("verifier", "temperature"), [("exact", 0.0), ("rejection", 1.0)])
def test_a_batch_of_trees_decodes_each_prompt_as_decode_does_alone(tiny, name, verifier, temperature):
    prompts = mixed_prompts()
    drafter = tree_drafter(name, tiny)
    settings = {"max_new_tokens": 24, "gamma": 4, "temperature": temperature}
    alone = [decode(tiny, drafter, verifier, prompt, seed=seed, **settings) for seed, prompt in enumerate(prompts)]
    for size in (2, 4):
        together = in_batches(tiny, drafter, verifier, prompts, size, **settings)
        assert [r.tokens for r in together] == [r.tokens for r in alone], f"B={size}"
        assert [[s.accepted for s in r.steps] for r in together] == [[s.accepted for s in r.steps] for r in alone]
        assert [[s.drafted for s in r.steps] for r in together] == [[s.drafted for s in r.steps] for r in alone]
    steps = [step for result in alone for step in result.steps]
    assert 0 < sum(step.accepted for step in steps) < sum(step.drafted for step in steps)  # kept and rejected drafts
    assert max(len(step.reasons) for step in steps) > 1  # paths deeper than one node were accepted


@pytest.mark.parametrize("name", ["model_tree", "eagle3"])
def test_greedy_trees_at_batch_2_and_4_equal_the_baseline(tiny, name):
    prompts = mixed_prompts()
    baseline = [decode(tiny, None, None, prompt, max_new_tokens=24).tokens for prompt in prompts]
    for size in (2, 4):
        together = in_batches(tiny, tree_drafter(name, tiny), "exact", prompts, size, max_new_tokens=24, gamma=5)
        assert [r.tokens for r in together] == baseline, f"B={size}"


def test_per_row_schedules_shadows_and_fidelity_over_trees_are_kept_as_alone(tiny):
    prompts = mixed_prompts()[:4]
    drafter = tree_drafter("model_tree", tiny)
    settings = {"max_new_tokens": 20, "gamma": 2, "temperature": 1.0, "shadow": ["mars", "typical"], "fidelity": True}
    alone = [decode(tiny, drafter, "rejection", prompt, seed=seed, draft_length=AcceptanceSchedule(2, maximum=5), **settings)
             for seed, prompt in enumerate(prompts)]  # fmt: skip
    together = decode_batch(tiny, drafter, "rejection", prompts, seeds=range(4), draft_length=AcceptanceSchedule(2, maximum=5),
                            **settings)  # fmt: skip
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    depths = [[len(s.reasons) for s in r.steps] for r in together]
    assert depths == [[len(s.reasons) for s in r.steps] for r in alone]
    assert [r.shadow_accepted(2) for r in together] == [r.shadow_accepted(2) for r in alone]
    for batched, single in zip(together, alone):
        for summed, expected in zip(batched.fidelity(), single.fidelity()):
            assert all(summed[key] == pytest.approx(expected[key], abs=1e-5) for key in summed)
    assert together[0].fidelity()


def test_an_eagle3_row_that_stops_leaves_the_batch_and_the_others_decode_on(tiny):
    prompts = mixed_prompts()
    drafter = eagle3(tiny)
    free = decode_batch(tiny, drafter, "exact", prompts, max_new_tokens=24, gamma=4)
    stop = free[2].tokens[5]
    alone = [decode(tiny, drafter, "exact", prompt, max_new_tokens=24, gamma=4, stop_token_ids=[stop]) for prompt in prompts]
    together = decode_batch(tiny, drafter, "exact", prompts, max_new_tokens=24, gamma=4, stop_token_ids=[stop])
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert together[2].stop_reason == "stop_token" and len(together[2].tokens) <= 6


def test_a_tree_budget_of_one_token_per_row_drafts_nothing_and_still_decodes(tiny):
    prompts = mixed_prompts()[:3]
    for name in ("model_tree", "eagle3"):
        together = decode_batch(tiny, tree_drafter(name, tiny), "exact", prompts, max_new_tokens=2, gamma=4)
        assert [r.tokens for r in together] == [decode(tiny, None, None, p, max_new_tokens=2).tokens for p in prompts]


def reads_per_step(target, drafter, prompts, temperature) -> list[int]:
    """Host reads of device data in each step, the models' outputs standing for device tensors (OnDevice)."""
    def on_device(module, args, output):
        if isinstance(output, tuple):  # the EAGLE-3 head: (logits, hidden)
            return tuple(part.as_subclass(OnDevice) for part in output)
        output.logits = output.logits.as_subclass(OnDevice)
        return output

    modules = [target, drafter.head if isinstance(drafter, Eagle3Drafter) else drafter.model]
    counts, step, grow = [], _Batch.step, GrowingTrees.__init__

    def grown_on_device(self, *args):  # the trees are allocated on the drafter's device
        grow(self, *args)
        for name in ("tokens", "parents", "scores", "logq", "ancestors"):
            setattr(self, name, getattr(self, name).as_subclass(OnDevice))

    def counted(self, rows, clock):
        with HostSyncs(only_on_device=True) as syncs:
            step(self, rows, clock)
        counts.append(syncs.count)

    hooks = [module.register_forward_hook(on_device) for module in modules]
    _Batch.step, GrowingTrees.__init__ = counted, grown_on_device
    try:
        decode_batch(target, drafter, "exact" if temperature == 0 else "rejection", prompts, seeds=range(len(prompts)),
                     max_new_tokens=10, gamma=3, temperature=temperature)  # fmt: skip
    finally:
        _Batch.step, GrowingTrees.__init__ = step, grow
        for hook in hooks:
            hook.remove()
    return counts


@pytest.mark.parametrize("name", ["model_tree", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_step_reads_the_host_twice_at_any_batch_size(tiny, name, temperature):
    """The rows' trees in one transfer, their verdicts in another; never once per row or per depth."""
    prompts = mixed_prompts()[:4]
    drafter = tree_drafter(name, tiny)
    for size in (1, 2, 4):
        for start in range(0, len(prompts), size):
            counts = reads_per_step(tiny, drafter, prompts[start : start + size], temperature)
            assert counts[:-1] == [2] * (len(counts) - 1), f"B={size}: {counts}"  # the last step may draft nothing
            assert counts[-1] in (1, 2)


class CountingClock(Clock):
    """The engine's clock, with every lap counted and each lap 1 s more than the one before (1, 2, 3, ...)."""

    made: list[CountingClock] = []

    def __init__(self, device) -> None:
        super().__init__(device)
        self.laps, self.made_on = 0, torch.device(device)
        CountingClock.made.append(self)

    def lap(self) -> float:
        super().lap()
        self.laps += 1
        return float(self.laps)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_batch_size_is_timed_by_the_one_clock(tiny, monkeypatch, size):
    """decode and decode_batch time every phase with ``decoding/clock.py``'s Clock, made on the target's input device,
    so on a GPU each lap is a device-synchronised CUDA event at every B (no host timer of its own)."""
    monkeypatch.setattr(engine, "Clock", CountingClock)
    CountingClock.made = []
    prompts = mixed_prompts()[:size]
    results = decode_batch(tiny, tree_drafter("model_tree", tiny), "exact", prompts, max_new_tokens=8, gamma=3)
    [clock] = CountingClock.made
    assert clock.made_on == tiny.device
    laps = set(range(1, clock.laps + 1))
    for result in results:
        assert result.prefill_s == 1.0  # the first lap
        for step in result.steps:
            assert {step.draft_s, step.target_s, step.verify_s, step.bookkeeping_s} <= laps
            assert step.draft_s < step.target_s < step.verify_s < step.bookkeeping_s  # one lap each, in order
            assert step.fidelity_s in laps or (step.fidelity_s == 0 and not step.drafted)  # a step with no verdicts has none
        assert result.decode_s == sum(s.draft_s + s.target_s + s.verify_s + s.bookkeeping_s for s in result.steps)
    assert not hasattr(engine, "time")  # no perf_counter beside the clock
