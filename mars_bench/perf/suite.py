"""The timed comparisons. Every number comes from wall-clock time around one whole decode
call (ours or transformers'), in one process, on the same prompts, with the order of the
two methods alternating per prompt and per repeat."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import OmegaConf

from mars_bench.bench.contention import ContentionMeter
from mars_bench.bench.manifest import cpu_description, git_state, gpu_description, package_versions, source_hash
from mars_bench.config import DrafterConfig, TaskConfig
from mars_bench.decoding import decode
from mars_bench.decoding.draft_length import draft_length_policy
from mars_bench.decoding.engine import cut_at_stop
from mars_bench.decoding.trace import PHASES
from mars_bench.drafting import drafter_for
from mars_bench.models import chat_prompt_ids, check_tokenizers_compatible, load_model, stop_token_ids
from mars_bench.paths import CONF_DIR
from mars_bench.perf.costs import ForwardTimer, forward_seconds, predicted_speedup
from mars_bench.perf.peer import assistant_settings, peer_generate, peer_generation_config
from mars_bench.tasks.providers import load_questions

CONF_TASKS = CONF_DIR / "task"


@dataclass(frozen=True)
class PerfSettings:
    target: str
    draft_model: str
    dtype: str = "bfloat16"
    tasks: tuple[str, ...] = ("humaneval", "gsm8k")
    num_prompts: int = 10
    max_new_tokens: int = 128
    repeats: int = 3
    gamma: int = 5
    draft_length: str = "fixed"
    data_dir: str | None = None

    def check(self) -> None:
        for option, value in (("num_prompts", self.num_prompts), ("max_new_tokens", self.max_new_tokens),
                              ("repeats", self.repeats), ("gamma", self.gamma)):  # fmt: skip
            if value < 1:
                raise ValueError(f"--{option.replace('_', '-')}={value} is invalid: allowed is an integer >= 1")
        draft_length_policy(self.draft_length, self.gamma)


@dataclass(frozen=True)
class Comparison:
    name: str
    temperature: float
    verifier: str | None  # ours: None = the autoregressive baseline
    assisted: bool  # transformers: assisted generation or plain generate


COMPARISONS = (
    Comparison("AR baseline vs generate (greedy)", 0.0, None, False),
    Comparison("chain exact vs assisted (greedy)", 0.0, "exact", True),
    Comparison("chain rejection vs assisted sampling (T=1)", 1.0, "rejection", True),
)


def task_prompts(tokenizer: Any, settings: PerfSettings) -> list[list[int]]:
    prompts = []
    for task in settings.tasks:
        option = CONF_TASKS / f"{task}.yaml"
        if not option.is_file():
            choices = ", ".join(sorted(p.stem for p in CONF_TASKS.glob("*.yaml")))
            raise ValueError(f"task {task!r} is unknown: allowed are {choices}")
        config = OmegaConf.merge(OmegaConf.structured(TaskConfig), OmegaConf.load(option), {"num_prompts": settings.num_prompts})
        for question in load_questions(config, settings.data_dir):
            prompts.append(chat_prompt_ids(tokenizer, [question.turns[0]], config.system_prompt))
    return prompts


class Suite:
    def __init__(self, settings: PerfSettings) -> None:
        settings.check()
        self.settings = settings
        self.target = load_model(settings.target, dtype=settings.dtype)
        self.draft = load_model(settings.draft_model, dtype=settings.dtype)
        check_tokenizers_compatible(self.target.tokenizer, self.draft.tokenizer)
        self.stops = stop_token_ids(self.target)
        self.prompts = task_prompts(self.target.tokenizer, settings)
        min_confidence = DrafterConfig.min_confidence if settings.draft_length == "confidence" else None
        self.drafter = drafter_for("model", self.target.model, self.draft.model, min_confidence=min_confidence)
        pad = self.target.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stops[0]
        self.meter = ContentionMeter()  # what other processes used while each decode was timed

    def ours(self, comparison: Comparison, prompt: list[int], seed: int, budget: int) -> dict[str, Any]:
        s = self.settings
        result, timing = self.timed(lambda: decode(
            self.target.model, self.drafter if comparison.verifier else None, comparison.verifier, prompt,
            max_new_tokens=budget, gamma=s.gamma, temperature=comparison.temperature, stop_token_ids=self.stops,
            seed=seed, draft_length=draft_length_policy(s.draft_length, s.gamma),
        ))  # fmt: skip
        return {"tokens": result.tokens, **timing, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
                "steps": result.verify_steps, "emitted": result.new_tokens - 1, "drafted": result.drafted,
                **{f"{phase}_s": value for phase, value in result.phase_seconds().items()}}  # fmt: skip

    def peer(self, comparison: Comparison, prompt: list[int], seed: int, budget: int) -> dict[str, Any]:
        config = peer_generation_config(budget, comparison.temperature, self.stops, self.pad_id)
        assistant = self.draft.model if comparison.assisted else None
        tokens, timing = self.timed(lambda: peer_generate(self.target.model, prompt, config, assistant, seed=seed))
        return {"tokens": cut_at_stop(tokens, self.stops, budget)[0], **timing}

    def timed(self, call: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        """``call()``, its wall seconds, and the count and seconds of each model's forwards inside it."""
        with ForwardTimer(self.target.model) as target, ForwardTimer(self.draft.model) as draft:
            self.meter.start()
            start = time.perf_counter()
            value = call()
            wall = time.perf_counter() - start
            contention = self.meter.stop()
        return value, {"seconds": wall, "target_forwards": target.calls, "target_forward_s": target.seconds,
                       "drafter_forwards": draft.calls, "drafter_forward_s": draft.seconds,
                       "other_load": contention.other_load, "disturbed": contention.disturbed()}  # fmt: skip

    def warm_up(self) -> None:
        for comparison in COMPARISONS:
            self.ours(comparison, self.prompts[0], 0, 8)
            self.peer(comparison, self.prompts[0], 0, 8)

    def repeat(self, comparison: Comparison, repeat: int) -> dict[str, Any]:
        ours, peer = [], []
        for index, prompt in enumerate(self.prompts):
            seed = 1000 * repeat + index
            budget = self.settings.max_new_tokens
            if (index + repeat) % 2 == 0:
                ours.append(self.ours(comparison, prompt, seed, budget))
                peer.append(self.peer(comparison, prompt, seed, budget))
            else:
                peer.append(self.peer(comparison, prompt, seed, budget))
                ours.append(self.ours(comparison, prompt, seed, budget))
        return {"ours": ours, "peer": peer}


def forward_use(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Target forwards per new token, and the mean seconds of a target and of a drafter forward."""
    totals = {key: sum(run[key] for run in runs) for key in ("target_forwards", "target_forward_s",
                                                             "drafter_forwards", "drafter_forward_s")}  # fmt: skip
    return {
        "target_forwards_per_token": totals["target_forwards"] / sum(len(run["tokens"]) for run in runs),
        "target_forward_ms": 1000 * totals["target_forward_s"] / max(1, totals["target_forwards"]),
        "drafter_forwards_per_target_forward": totals["drafter_forwards"] / max(1, totals["target_forwards"]),
        "drafter_forward_ms": 1000 * totals["drafter_forward_s"] / max(1, totals["drafter_forwards"]),
    }


def throughput(runs: list[dict[str, Any]], seconds: str = "seconds") -> float:
    return sum(len(run["tokens"]) for run in runs) / sum(run[seconds] for run in runs)


def summarise(comparison: Comparison, repeats: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [throughput(r["ours"]) / throughput(r["peer"]) for r in repeats]
    per_prompt = [throughput([a]) / throughput([b]) for r in repeats for a, b in zip(r["ours"], r["peer"])]
    ours = [run for r in repeats for run in r["ours"]]
    identical = sum(a["tokens"] == b["tokens"] for r in repeats for a, b in zip(r["ours"], r["peer"]))
    decode_s = sum(run["decode_s"] for run in ours)
    phases = {phase: sum(run[f"{phase}_s"] for run in ours) / decode_s for phase in PHASES}
    steps = sum(run["steps"] for run in ours)
    return {
        "comparison": comparison.name,
        "ours_tok_s": throughput(ours),
        "peer_tok_s": throughput([run for r in repeats for run in r["peer"]]),
        "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios), "ratios": ratios,
        "prompt_ratio_min": min(per_prompt), "prompt_ratio_median": statistics.median(per_prompt),
        "prompt_ratio_max": max(per_prompt),
        "identical": identical if comparison.temperature == 0 else None,
        "runs": len(ours),
        "disturbed_runs": sum(run["disturbed"] for r in repeats for run in (*r["ours"], *r["peer"])),
        "phase_share": phases,
        # Prefill forwards are counted too, so this slightly overstates the decode loop's share.
        "outside_forwards_share": sum(run["prefill_s"] + run["decode_s"] - run["target_forward_s"] - run["drafter_forward_s"]
                                      for run in ours) / decode_s,  # fmt: skip
        "tau": sum(run["emitted"] for run in ours) / steps,
        "drafts_per_step": sum(run["drafted"] for run in ours) / steps,
        "ours_decode_tok_s": sum(run["emitted"] for run in ours) / decode_s,
        "ours_forwards": forward_use(ours),
        "peer_forwards": forward_use([run for r in repeats for run in r["peer"]]),
    }  # fmt: skip


def forward_costs(suite: Suite) -> dict[str, Any]:
    """Forward seconds at a typical context: the prompts' median length plus half the budget."""
    s = suite.settings
    context = int(statistics.median(len(p) for p in suite.prompts)) + s.max_new_tokens // 2
    return {
        "context_tokens": context,
        "target_1": forward_seconds(suite.target.model, context, 1),
        f"target_{s.gamma + 1}": forward_seconds(suite.target.model, context, s.gamma + 1),
        "drafter_1": forward_seconds(suite.draft.model, context, 1),
    }


def analytic_model(settings: PerfSettings, costs: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The speedup over our AR baseline that the forward costs and the measured tau predict."""
    s = settings
    baseline = results[COMPARISONS[0].name]
    predictions = {}
    for comparison in COMPARISONS[1:]:
        row = results[comparison.name]
        predicted = predicted_speedup(row["tau"], row["drafts_per_step"], costs["target_1"],
                                      costs[f"target_{s.gamma + 1}"], costs["drafter_1"])  # fmt: skip
        measured = row["ours_decode_tok_s"] / baseline["ours_decode_tok_s"]
        predictions[comparison.name] = {"predicted": predicted, "measured": measured, "ratio": measured / predicted}
    return {"costs": costs, "speedup_over_our_baseline": predictions}


def run_suite(settings: PerfSettings, after_repeat: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every comparison, ``settings.repeats`` times; ``after_repeat`` gets the report over the
    repeats done so far (so an interrupted run keeps what it measured)."""
    # Read once, as the run starts: a report rewritten after each repeat describes that start.
    environment = {"git": git_state(), "source_sha256": source_hash(), "packages": package_versions(),
                   "cpu": cpu_description(), "gpus": gpu_description()}  # fmt: skip
    suite = Suite(settings)
    suite.warm_up()
    costs = forward_costs(suite)
    raw: dict[str, list[dict[str, Any]]] = {c.name: [] for c in COMPARISONS}
    for repeat in range(settings.repeats):
        for comparison in COMPARISONS:
            raw[comparison.name].append(suite.repeat(comparison, repeat))
        report = build_report(suite, environment, costs, raw, repeat + 1)
        if after_repeat is not None:
            after_repeat(report)
    return report


def build_report(
    suite: Suite, environment: dict[str, Any], costs: dict[str, Any], raw: dict[str, list[dict[str, Any]]], repeats_done: int
) -> dict[str, Any]:
    results = {c.name: summarise(c, raw[c.name]) for c in COMPARISONS}
    return {
        "settings": asdict(suite.settings),
        "environment": environment,
        "repeats_done": repeats_done,
        "prompts": len(suite.prompts),
        "assisted_generation": assistant_settings(suite.draft.model),
        "results": results,
        "analytic": analytic_model(suite.settings, costs, results),
        "raw": {name: [{side: [{"seconds": run["seconds"], "tokens": len(run["tokens"])} for run in r[side]]
                               for side in ("ours", "peer")} for r in repeats] for name, repeats in raw.items()},  # fmt: skip
    }
