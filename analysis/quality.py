"""The quality table: each verifier's task score, its paired difference from the strict
verifier on the same prompts, a bootstrap 95% CI of that difference and a paired test.

The strict verifier is ``mars_bench.common.strict_rule.strict_verifier`` of the temperature. Where a
sweep did not run it, the autoregressive baseline stands in: it samples the target's own
distribution, which the strict rule preserves, so the comparison means the same thing.

A score over an answer cut at the token budget measures the budget too: the difference counts only the
prompts where both answers finished (``left_out``: the pairs a cut answer left out), unless
``include_cut`` counts them (``cut``: how many of the counted pairs hold a cut answer, marked ``†``).
"""

from __future__ import annotations

import pandas as pd

from mars_bench.bench.records import BASELINE
from mars_bench.bench.stats import bootstrap_mean_ci, paired_permutation_p
from mars_bench.bench.summary import cut_answers
from mars_bench.common.strict_rule import strict_verifier

from .cells import PROMPT, NotEnoughData, baseline_rows, method_rows

GROUP = ["model", "drafter", "task", "temperature", "conditions"]


def quality_table(frame: pd.DataFrame, include_cut: bool = False) -> pd.DataFrame:
    """One row per (model, drafter, task, temperature, conditions, method) with a score; a method is
    compared with the baselines of its own baseline conditions only."""
    methods = method_rows(frame).dropna(subset=["score"])
    if methods.empty:
        raise NotEnoughData("no finished rows carry a score (is task.scorer set?)")
    base = baseline_rows(frame).dropna(subset=["score"]).assign(label="baseline")
    out = []
    for key, group in methods.groupby(GROUP, sort=True):
        model, _drafter, task, temperature, conditions = key
        same = ((base["model"] == model) & (base["task"] == task) & (base["temperature"] == temperature)
                & (base["conditions"] == conditions))  # fmt: skip
        candidates = pd.concat([group, base[same]]).drop_duplicates(["label", *PROMPT])
        references = strict_labels(group, strict_verifier(temperature))
        for label, rows in candidates.groupby("label", sort=True):
            reference = reference_label(rows, references)
            if label == reference:
                continue
            ref_scores = candidates[candidates["label"] == reference][[*PROMPT, "score", "finished"]]
            pairs = rows[[*PROMPT, "score", "finished"]].merge(ref_scores, on=PROMPT, suffixes=("", "_ref"))
            if pairs.empty:
                continue
            cut = cut_answers(pairs["finished"]) | cut_answers(pairs["finished_ref"])
            finished = int(sum(bool(value) for value in pairs["finished"].dropna()))
            counted = pairs if include_cut else pairs[~cut]
            if counted.empty:
                out.append({**dict(zip(GROUP, key)), "method": label, "prompts": 0, "finished": finished,
                            "answers": len(pairs), "left_out": int(cut.sum()), "cut": 0, "reference": reference})  # fmt: skip
                continue
            pairs = counted
            differences = pairs["score"] - pairs["score_ref"]
            low, high = bootstrap_mean_ci(differences)
            out.append(
                {
                    **dict(zip(GROUP, key)),
                    "method": label,
                    "prompts": len(pairs),
                    "finished": finished,
                    "answers": len(cut),  # every scored pair, counted or left out
                    "left_out": 0 if include_cut else int(cut.sum()),
                    "cut": int(cut.sum()) if include_cut else 0,
                    "score": pairs["score"].mean(),
                    "reference": reference,
                    "reference_score": pairs["score_ref"].mean(),
                    "difference": differences.mean(),
                    "ci_low": low,
                    "ci_high": high,
                    "p_value": paired_permutation_p(differences),
                }
            )
    if not out:
        raise NotEnoughData("no method has a strict verifier's or a baseline's scores on the same prompts to compare with")
    return pd.DataFrame(out)


def strict_labels(methods: pd.DataFrame, strict: str) -> dict[str, str]:
    """Draft-length policy -> the label of the strict verifier's rows run with it (a label carries the
    policy where it is not fixed: ``rejection, confidence length``), over ``methods`` (method rows)."""
    rows = methods[(methods["verifier"] == strict) & (methods["verifier_setting"].fillna("") == "")]
    return dict(zip(rows["draft_length"], rows["label"]))


def reference_label(rows: pd.DataFrame, references: dict[str, str]) -> str:
    """What ``rows`` (one label's) are compared with: the strict verifier's rows of the same draft-length
    policy, the one strict label there is for the baseline's rows, else the baseline."""
    length = rows["draft_length"].iloc[0] if rows["method"].iloc[0] != BASELINE else None
    if length in references:
        return references[length]
    if length is None and len(set(references.values())) == 1:
        return next(iter(references.values()))
    return "baseline"
