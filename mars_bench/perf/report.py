"""perf.json -> the Markdown tables of the README's performance section."""

from __future__ import annotations

from typing import Any

from mars_bench.bench.contention import DEFAULT_THRESHOLD


def spread(row: dict[str, Any]) -> tuple[str, str]:
    """``median x [min, max]`` over repeats and over single prompts."""
    return (f"{row['median']:.3f}x [{row['min']:.3f}, {row['max']:.3f}]",
            f"{row['prompt_median']:.2f}x [{row['prompt_min']:.2f}, {row['prompt_max']:.2f}]")  # fmt: skip


def header(result: dict[str, Any]) -> str:
    s = result["settings"]
    vocabs = ", ".join("all" if v is None else str(v) for v in s["draft_vocabs"])
    return (f"{s['target']} with {s['draft_model']}, {s['dtype']}, {result['prompts']} prompts ({', '.join(s['tasks'])}), "
            f"{s['max_new_tokens']} new tokens, gamma {s['gamma']}, draft lengths {', '.join(s['draft_lengths'])}, "
            f"draft vocabularies {vocabs}, {result['repeats_done']} of {s['repeats']} repeats; transformers' models: "
            f"`{result['peer_loading']}`; assisted generation: {result['assisted_generation']}.")  # fmt: skip


def speed_table(result: dict[str, Any]) -> list[str]:
    lines = ["| method | against | tok/s | ratio over repeats: median [min, max] | per prompt: median [min, max] "
             "| identical outputs |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["comparisons"]:
        identical = "-" if row["identical"] is None else f"{row['identical']}/{row['runs']}"
        repeats, prompts = spread(row)
        tok_s = result["results"][row["method"]]["tok_s"]
        lines.append(f"| {row['method']} | {row['against']} | {tok_s:.2f} | {repeats} | {prompts} | {identical} |")
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
        lines.append(f"| {row['method']} | {use['target_forwards_per_token']:.3f} | {use['target_forward_ms']:.1f} | "
                     f"{use['drafter_forwards_per_target_forward']:.2f} | {use['drafter_forward_ms']:.1f} |")  # fmt: skip
    return lines


def analytic_table(result: dict[str, Any]) -> list[str]:
    analytic = result["analytic"]
    costs = analytic["costs"]
    target = ", ".join(f"{width} {seconds * 1000:.1f}" for width, seconds in costs["target"].items())
    drafter = ", ".join(f"{'all' if vocab == 'None' else vocab} {s * 1000:.1f}" for vocab, s in costs["drafter"].items())
    lines = [f"Forward costs at a {costs['context_tokens']}-token context (median of 10), ms: target by tokens fed: {target}; "
             f"drafter, one token, by draft vocabulary: {drafter}.", "",
             "| ours | predicted speedup over our AR baseline | measured (decode only) | measured / predicted |",
             "|---|---|---|---|"]  # fmt: skip
    for name, row in analytic["speedup_over_our_baseline"].items():
        lines.append(f"| {name} | {row['predicted']:.2f}x | {row['measured']:.2f}x | {row['ratio']:.1%} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    lines = [header(result), "", *speed_table(result)]
    disturbed = sum(row.get("disturbed_runs", 0) for row in result["results"].values())
    if disturbed:
        lines += ["", f"**{disturbed} timed decodes ran while other processes used the machine (more than "
                      f"{DEFAULT_THRESHOLD} cores on average): these numbers are not clean; run again on an idle "
                      "machine.**"]  # fmt: skip
    return "\n".join([*lines, "", *ours_tables(result), "", *analytic_table(result)])
