"""Which run folders pooled into one setting, and the repeats that pool only when asked.

Several folders may hold rows of one setting (cells.SETTING). A resumed run writes into its own
folder again, so it stays one folder. A sweep sharded over machines, or a run continued in a new
folder with other prompts, gives several folders whose prompts are disjoint: they pool, each prompt
once. Folders that measured the same prompt of one setting more than once are repeats (the same
command run twice, an old run left beside a new one): pooled, each such prompt would count once per
folder, as if it were several prompts, and every interval would narrow for it. ``python -m analysis``
refuses repeats unless ``--pool-repeats`` asks for them, and its index.md lists every setting it
pooled from several folders.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from .cells import PROMPT, SETTING, NotEnoughData, method_rows, setting_name

POOL_REPEATS = "--pool-repeats"  # the analysis's option that pools repeated runs of one setting


@dataclass(frozen=True)
class Pooled:
    """One setting whose rows come from several run folders."""

    setting: str  # readable: ``rejection on humaneval (qwen, model, T=1)`` (cells.setting_name)
    folders: tuple[str, ...]  # the run folders (``run_dir``), sorted
    prompts: int  # distinct prompts (question and turn) over all of them
    repeated: int  # prompts that more than one folder measured (0: the folders' prompts are disjoint)


def pooled_settings(frame: pd.DataFrame) -> list[Pooled]:
    """The settings whose finished method rows come from more than one run folder, in setting order."""
    try:
        rows = method_rows(frame)
    except NotEnoughData:
        return []
    out = []
    for _key, group in rows.groupby(SETTING, dropna=False, sort=True):
        folders = tuple(sorted(group["run_dir"].unique()))
        if len(folders) < 2:
            continue
        per_prompt = group.drop_duplicates(["run_dir", *PROMPT]).groupby(PROMPT)["run_dir"].nunique()
        out.append(Pooled(setting_name(group.iloc[0]), folders, len(per_prompt), int((per_prompt > 1).sum())))
    return out


def repeats(pooled: list[Pooled]) -> list[Pooled]:
    """The pooled settings some of whose prompts were measured in more than one folder."""
    return [entry for entry in pooled if entry.repeated]
