"""perf.json -> the Markdown tables of a perf run (docs/performance.md)."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mars_bench.bench.contention import DEFAULT_THRESHOLD

# The layout of perf.json. 2: a drafter configuration (settings.configurations, a result's config) is its draft-length
# policy and its drafter's own settings by their names, {"length", "settings": {"draft_vocab", "weights", ...}}, and the
# settings name the drafter and the backend. 1 (reports without "version"): {"length", "vocab", "weights", "guesses",
# "context_vocab"}, the last three missing from the earliest.
REPORT_VERSION = 2


def spread(row: dict[str, Any]) -> tuple[str, str]:
    """``median x [min, max]`` over repeats and over single prompts."""
    return (f"{row['median']:.3f}x [{row['min']:.3f}, {row['max']:.3f}]",
            f"{row['prompt_median']:.2f}x [{row['prompt_min']:.2f}, {row['prompt_max']:.2f}]")  # fmt: skip


def config_label(
    length: str, vocab: int | None, weights: str | None = None, guesses: int = 0, context_vocab: bool = False
) -> str:
    """A drafter configuration's name: its draft-length policy, its draft vocabulary if reduced (and
    whether it holds the context's tokens), its weights if quantized, its lookup guesses per drafter
    forward if any."""
    return (length + (f" + vocab {vocab}" if vocab else "") + (" + context tokens" if context_vocab else "")
            + (f" + {weights} weights" if weights else "") + (f" + {guesses} guesses" if guesses else ""))  # fmt: skip


def drafter_label(length: str, settings: Mapping[str, Any]) -> str:
    """A drafter configuration's name from its draft-length policy and its drafter's settings by name."""
    return config_label(length, settings.get("draft_vocab"), settings.get("weights"), settings.get("guesses", 0),
                        settings.get("context_vocab", False))  # fmt: skip


def configuration_name(config: dict[str, Any], version: int) -> str:
    """The name of a configuration as a report of layout ``version`` records it (``REPORT_VERSION``)."""
    return drafter_label(config["length"], config["settings"]) if version >= 2 else config_label(**config)


def header(result: dict[str, Any]) -> str:
    s = result["settings"]
    if s.get("configurations"):
        version = result.get("version", 1)
        configs = "drafter configurations " + ", ".join(configuration_name(config, version) for config in s["configurations"])
    else:
        vocabs = ", ".join("all" if v is None else str(v) for v in s["draft_vocabs"])
        configs = f"draft lengths {', '.join(s['draft_lengths'])}, draft vocabularies {vocabs}"
    skipped = s.get("skip_prompts", 0)
    taken = f"{result['prompts']} prompts ({', '.join(s['tasks'])}"
    taken += f"; each task's prompts {skipped + 1} to {skipped + s['num_prompts']})" if skipped else ")"
    text = (f"{s['target']} with {s['draft_model']}, {s['dtype']}, {taken}, "
            f"{s['max_new_tokens']} new tokens, gamma {s['gamma']}{policy_keys(s)}, {configs}, "
            f"{result['repeats_done']} of {s['repeats']} repeats")  # fmt: skip
    if result.get("peer_loading"):  # None where no transformers method was timed
        text += f"; transformers' models: `{result['peer_loading']}`; assisted generation: {result['assisted_generation']}"
    for peer, load in (result.get("vllm_loading") or {}).items():  # reports written before vLLM's peers lack it
        text += (f"; {peer}: vLLM {load['vllm']}, `LLM(dtype={load['dtype']}, enforce_eager={load['enforce_eager']}, "
                 f"max_num_seqs={load['max_num_seqs']}, speculative_config={load['speculative_config']})` with a "
                 f"{load['kv_cache_gb']:g} GB KV cache, loaded in {load['load_s']:.0f} s")  # fmt: skip
    return text + "."


def policy_keys(settings: dict[str, Any]) -> str:
    """The draft-length keys the run's policies read (schedule: max_gamma; confidence: the stop; gain: the
    draft cost), as the header lists them after gamma."""
    configurations = settings.get("configurations")
    policies = {config["length"] for config in configurations} if configurations else set(settings.get("draft_lengths") or ())
    keys = {"schedule": ("max_gamma", "max gamma {}"), "confidence": ("min_confidence", "stop at q < {}"),
            "gain": ("draft_cost", "draft cost {} target forwards")}  # fmt: skip
    return "".join(f", {text.format(settings[key])}" for policy, (key, text) in keys.items()
                   if policy in policies and key in settings)  # fmt: skip


def prompt_tasks(result: dict[str, Any]) -> list[str]:
    """The task of each timed prompt, in order. Reports written before ``prompt_tasks`` was
    recorded took ``num_prompts`` prompts from each task in turn."""
    if "prompt_tasks" in result:
        return result["prompt_tasks"]
    settings = result["settings"]
    tasks = [task for task in settings["tasks"] for _ in range(settings["num_prompts"])]
    if len(tasks) != result["prompts"]:
        raise ValueError(f"the report has {result['prompts']} prompts and no prompt_tasks: cannot tell their tasks")
    return tasks


def task_ratios(result: dict[str, Any], method: str, against: str) -> dict[str, float]:
    """Per task: the median over repeats of ``method``'s throughput over ``against``'s on that
    task's prompts alone (from the report's raw seconds and token counts)."""
    tasks = prompt_tasks(result)
    picked = {task: [index for index, name in enumerate(tasks) if name == task] for task in tasks}
    ratios: dict[str, list[float]] = {task: [] for task in picked}
    for mine, other in zip(result["raw"][method], result["raw"][against]):
        for task, indices in picked.items():
            tok_s = [sum(runs[i]["tokens"] for i in indices) / sum(runs[i]["seconds"] for i in indices) for runs in (mine, other)]
            ratios[task].append(tok_s[0] / tok_s[1])
    return {task: statistics.median(values) for task, values in ratios.items()}


def speed_table(result: dict[str, Any]) -> list[str]:
    lines = ["| method | against | tok/s | ratio over repeats: median [min, max] | per prompt: median [min, max] "
             "| per task: median over repeats | identical outputs | what differs (all else the same) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["comparisons"]:
        identical = "-" if row["identical"] is None else f"{row['identical']}/{row['runs']}"
        repeats, prompts = spread(row)
        tasks = ", ".join(f"{task} {ratio:.2f}x" for task, ratio in task_ratios(result, row["method"], row["against"]).items())
        tok_s = result["results"][row["method"]]["tok_s"]
        differs = row.get("differs", "")  # reports written before it lack it
        lines.append(f"| {row['method']} | {row['against']} | {tok_s:.2f} | {repeats} | {prompts} | {tasks} | {identical} "
                     f"| {differs} |")  # fmt: skip
    return lines


def ours_tables(result: dict[str, Any]) -> list[str]:
    ours = [row for row in result["results"].values() if row["side"] == "ours"]
    lines = ["Phase profile of our decode time (share of decode seconds):", "",
             "| ours | draft | target forward | verify | bookkeeping | time outside model forwards | tau | drafts per step |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in ours:
        p = row["phase_share"]
        lines.append(f"| {row['method']} | {p['draft']:.1%} | {p['target']:.1%} | {p['verify']:.2%} | {p['bookkeeping']:.2%} | "
                     f"{row['outside_forwards_share']:.2%} | {row['tau']:.2f} | {row['drafts_per_step']:.2f} |")  # fmt: skip
    lines += ["", "Model forwards inside each decode (counted by hooks; prefill included):", "",
              "| method | target forwards per token | ms per target forward | drafter forwards per target forward "
              "| ms per drafter forward |", "|---|---|---|---|---|"]  # fmt: skip
    for row in result["results"].values():
        use = row["forwards"]
        if use is None:  # vLLM's forwards run in its own process
            continue
        lines.append(f"| {row['method']} | {use['target_forwards_per_token']:.3f} | {use['target_forward_ms']:.1f} | "
                     f"{use['drafter_forwards_per_target_forward']:.2f} | {use['drafter_forward_ms']:.1f} |")  # fmt: skip
    return lines


def analytic_table(result: dict[str, Any]) -> list[str]:
    analytic = result["analytic"]
    costs = analytic["costs"]
    target = ", ".join(f"{width} {seconds * 1000:.1f}" for width, seconds in costs["target"].items())
    drafter = ", ".join(f"{key.replace('None', 'all')} {s * 1000:.1f}" for key, s in costs["drafter"].items())
    lines = [f"Forward costs at a {costs['context_tokens']}-token context (median of 10), ms: target by tokens fed: {target}; "
             f"drafter, one token, by draft vocabulary (and weights): {drafter}.", "",
             "| ours | predicted speedup over our AR baseline (calibrated) | predicted from the isolated costs "
             "| measured (decode only) | measured / predicted | predicted decode tok/s | measured decode tok/s "
             "| measured / predicted tok/s | drafter ms per draft (its decodes' own) "
             "| the model's best cap on drafts per step (its prediction) | measured / that optimum |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in analytic["speedup_over_our_baseline"].items():
        predicted_tok_s = predicted_decode_tok_s(row, costs)
        measured_tok_s = result["results"][name]["decode_tok_s"]
        best = row.get("best_cap")  # reports written before it lack it
        capped = {int(cap): speedup for cap, speedup in row.get("capped", {}).items()}  # JSON keeps caps as strings
        optimum = f"{best} ({capped[best]:.2f}x)" if best else "-"
        of_optimum = f"{row['of_optimum']:.1%}" if best else "-"
        isolated = f"{row['predicted_isolated']:.2f}x" if "predicted_isolated" in row else "-"  # before calibration: = predicted
        per_draft = f"{row['draft_s'] * 1000:.1f}" if "draft_s" in row else "-"
        lines.append(f"| {name} | {row['predicted']:.2f}x | {isolated} | {row['measured']:.2f}x | {row['ratio']:.1%} | "
                     f"{predicted_tok_s:.2f} | {measured_tok_s:.2f} | {measured_tok_s / predicted_tok_s:.1%} | {per_draft} | "
                     f"{optimum} | {of_optimum} |")  # fmt: skip
    lines += ["", "The calibrated prediction prices each forward by the tokens it was fed, from the decodes' own "
              "forwards (prefills left out): the AR baseline's one-token forwards for autoregressive decoding, the "
              "method's own target and drafter forwards for its steps.",
              "", "The best cap cuts the steps the decode took at each cap k (min(drafted, k) drafts; k + 1 tokens where a "
              "step accepted more than k, else what it emitted); it cannot see past the deepest draft made, and ignores "
              "that a cap moves where later steps start."]
    return lines


def predicted_decode_tok_s(row: dict[str, Any], costs: dict[str, Any]) -> float:
    """The chain's decode tokens per second that the forward costs alone predict: the analytic
    speedup without its AR side (one one-token target forward per token, the one the prediction
    priced them at), so the check against the measured decode throughput does not hang on that
    one time."""
    one_token_s = row.get("one_token_s")  # reports written before calibration priced it in isolation
    if one_token_s is None:
        one_token_s = {int(width): seconds for width, seconds in costs["target"].items()}[1]  # JSON keeps widths as strings
    return row["predicted"] / one_token_s


def markdown(result: dict[str, Any]) -> str:
    lines = [header(result), "", *speed_table(result)]
    disturbed = sum(row.get("disturbed_runs", 0) for row in result["results"].values())
    if disturbed:
        lines += ["", f"**{disturbed} timed decodes ran while other processes used the machine (more than "
                      f"{DEFAULT_THRESHOLD} cores on average): these numbers are not clean; run again on an idle "
                      "machine.**"]  # fmt: skip
    for row in result["results"].values():
        if row["side"] == "vllm" and row.get("tau") is not None:
            lines += ["", f"{row['method']}: tau {row['tau']:.2f} and {row['drafts_per_step']:.2f} drafts per step, from "
                          "vLLM's own spec-decode counters (its steps that drafted)."]  # fmt: skip
    return "\n".join([*lines, "", *ours_tables(result), "", *analytic_table(result)])


def main(argv: list[str] | None = None) -> int:
    """``python -m mars_bench.perf.report PERF_JSON``: the report's Markdown again, from its perf.json."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_file():
        print(f"perf.report: error: {' '.join(args) or 'nothing'} given: allowed is the path of one perf.json", file=sys.stderr)
        return 2
    try:
        text = markdown(json.loads(Path(args[0]).read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        print(f"perf.report: error: {args[0]} is not a perf suite report ({type(error).__name__}: {error})", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
