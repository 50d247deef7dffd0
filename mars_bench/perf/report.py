"""perf.json -> the Markdown tables of the README's performance section."""

from __future__ import annotations

from typing import Any

from mars_bench.bench.contention import DEFAULT_THRESHOLD


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"{s['target']} with {s['draft_model']}, {s['dtype']}, {result['prompts']} prompts ({', '.join(s['tasks'])}), "
        f"{s['max_new_tokens']} new tokens, gamma {s['gamma']} ({s['draft_length']}), "
        f"{result['repeats_done']} of {s['repeats']} repeats; "
        f"assisted generation: {result['assisted_generation']}.",
        "",
        "| comparison | ours tok/s | transformers tok/s | ours / transformers over repeats: min | median | max "
        "| per prompt: min | median | max | identical outputs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["results"].values():
        identical = "-" if row["identical"] is None else f"{row['identical']}/{row['runs']}"
        lines.append(f"| {row['comparison']} | {row['ours_tok_s']:.2f} | {row['peer_tok_s']:.2f} | {row['ratio_min']:.3f}x | "
                     f"{row['ratio_median']:.3f}x | {row['ratio_max']:.3f}x | {row['prompt_ratio_min']:.2f}x | "
                     f"{row['prompt_ratio_median']:.2f}x | {row['prompt_ratio_max']:.2f}x | {identical} |")  # fmt: skip
    disturbed = sum(row.get("disturbed_runs", 0) for row in result["results"].values())
    if disturbed:
        lines += ["", f"**{disturbed} timed decodes ran while other processes used the machine (more than "
                      f"{DEFAULT_THRESHOLD} cores on average): these numbers are not clean; run again on an idle "
                      "machine.**"]  # fmt: skip
    lines += ["", "Phase profile of our decode time (share of decode seconds):", "",
              "| ours | draft | target forward | verify | bookkeeping | time outside model forwards | tau |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["results"].values():
        p = row["phase_share"]
        lines.append(f"| {row['comparison'].split(' vs ')[0]} | {p['draft']:.1%} | {p['target']:.1%} | {p['verify']:.2%} | "
                     f"{p['bookkeeping']:.2%} | {row['outside_forwards_share']:.2%} | {row['tau']:.2f} |")  # fmt: skip
    lines += ["", "Model forwards inside each decode (counted by hooks; prefill included):", "",
              "| comparison | side | target forwards per token | ms per target forward | drafter forwards per target forward "
              "| ms per drafter forward |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["results"].values():
        for side, label in (("ours_forwards", "ours"), ("peer_forwards", "transformers")):
            use = row[side]
            lines.append(f"| {row['comparison']} | {label} | {use['target_forwards_per_token']:.3f} | "
                         f"{use['target_forward_ms']:.1f} | {use['drafter_forwards_per_target_forward']:.2f} | "
                         f"{use['drafter_forward_ms']:.1f} |")  # fmt: skip
    analytic = result["analytic"]
    costs = analytic["costs"]
    forwards = ", ".join(f"{name} {value * 1000:.1f} ms" for name, value in costs.items() if name != "context_tokens")
    lines += ["", f"Forward costs at a {costs['context_tokens']}-token context (median of 10): {forwards}.", "",
              "| ours | predicted speedup over our AR baseline | measured (decode only) | measured / predicted |",
              "|---|---|---|---|"]  # fmt: skip
    for name, row in analytic["speedup_over_our_baseline"].items():
        lines.append(f"| {name.split(' vs ')[0]} | {row['predicted']:.2f}x | {row['measured']:.2f}x | "
                     f"{row['ratio']:.1%} |")  # fmt: skip
    return "\n".join(lines)
