"""The questions of the ``gsm8k_local`` task, from the app's own prompt sources.

lm-eval calls ``gsm8k_test`` (the task's ``custom_dataset``) instead of reading a fixed file, so the
example runs from a bare clone: the questions come from the first of the app's ``gsm8k`` sources that
has them: the MARS prompt file (``$MARS_BENCH_DATA`` or ``../shared/data`` beside the checkout), the Hub
dataset, or the pinned registry package, as ``python -m mars_bench task=gsm8k`` reads them.
"""

from __future__ import annotations

from typing import Any


def gsm8k_test(**metadata: Any) -> Any:
    """A ``datasets.DatasetDict`` with one split, ``test``: each question's ``turns`` and ``reference``."""
    from datasets import Dataset, DatasetDict

    from mars_bench.tasks.options import task_option
    from mars_bench.tasks.providers import load_questions

    questions = load_questions(task_option("gsm8k", num_prompts=None))
    rows = [{"question_id": str(q.question_id), "turns": q.turns, "reference": q.reference} for q in questions]
    return DatasetDict({"test": Dataset.from_list(rows)})
