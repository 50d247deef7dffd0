"""The quality table: each verifier's task score, its paired difference from the strict
verifier on the same prompts, a bootstrap 95% CI of that difference and a paired test.

The strict verifier is ``mars_bench.strict_rule.strict_verifier`` of the temperature. Where a
sweep did not run it, the autoregressive baseline stands in: it samples the target's own
distribution, which the strict rule preserves, so the comparison means the same thing.
"""

from __future__ import annotations

import pandas as pd

from mars_bench.bench.stats import bootstrap_mean_ci, paired_permutation_p
from mars_bench.strict_rule import strict_verifier

from .cells import PROMPT, NotEnoughData, baseline_rows, method_rows

GROUP = ["model", "drafter", "task", "temperature", "conditions"]


def quality_table(frame: pd.DataFrame) -> pd.DataFrame:
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
        strict = strict_verifier(temperature)
        reference = strict if (candidates["label"] == strict).any() else "baseline"
        ref_scores = candidates[candidates["label"] == reference][[*PROMPT, "score"]]
        for label, rows in candidates.groupby("label", sort=True):
            if label == reference:
                continue
            pairs = rows[[*PROMPT, "score"]].merge(ref_scores, on=PROMPT, suffixes=("", "_ref"))
            if pairs.empty:
                continue
            differences = pairs["score"] - pairs["score_ref"]
            low, high = bootstrap_mean_ci(differences)
            out.append(
                {
                    **dict(zip(GROUP, key)),
                    "method": label,
                    "prompts": len(pairs),
                    "score": pairs["score"].mean(),
                    "reference": reference,
                    "reference_score": pairs["score_ref"].mean(),
                    "difference": differences.mean(),
                    "ci_low": low,
                    "ci_high": high,
                    "p_value": paired_permutation_p(differences),
                }
            )
    return pd.DataFrame(out)
