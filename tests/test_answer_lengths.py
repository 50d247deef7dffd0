"""benchmarks/answer_lengths.py: the share of answers that finish at each budget, from records."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "answer_lengths.py"


def write_rows(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_an_answer_finishes_at_every_budget_at_least_its_length_and_a_cut_one_at_none(tmp_path):
    script = load_script(SCRIPT)
    base = {"status": "ok", "task": "gsm8k", "max_new_tokens": 512}
    write_rows(tmp_path / "run", [
        {**base, "new_tokens": 100, "finished": True},
        {**base, "new_tokens": 300, "finished": True},
        {**base, "new_tokens": 512, "finished": False},
        {**base, "new_tokens": 512, "stop_reason": "max_new_tokens"},  # an older record: no finished field
        {**base, "status": "failed", "new_tokens": 0, "finished": False},
    ])  # fmt: skip
    rows = script.answer_lengths([tmp_path])
    assert script.finished_share(rows["gsm8k"], 128) == (1, 4)
    assert script.finished_share(rows["gsm8k"], 512) == (2, 4)
    assert script.finished_share(rows["gsm8k"], 1024) is None  # above the run's own budget: unknown
    assert script.table(rows, [256, 1024]).splitlines()[2] == "| gsm8k | 1/4 (25%) | - |"


def test_the_committed_measurement_gives_the_recipes_budgets():
    """Each recipe's budget is at least the least budget at which >= 90% of each of its tasks' answers finished."""
    script = load_script(SCRIPT)
    rows = script.answer_lengths([REPO / "benchmarks" / "results" / "answer_lengths_t1_cpu"])
    budgets = (128, 256, 384, 512, 640, 768, 1024)

    def least(*tasks: str) -> int:
        return min(b for b in budgets if all((s := script.finished_share(rows[t], b))[0] >= 0.9 * s[1] for t in tasks))

    import yaml

    def recipe_budget(name: str) -> int:
        return yaml.safe_load((REPO / "conf" / "experiment" / f"{name}.yaml").read_text())["max_new_tokens"]

    assert least("humaneval", "gsm8k") <= recipe_budget("threshold_ablation")
    for name in ("zoo", "decomposition"):
        assert least("humaneval", "gsm8k", "mt_bench") <= recipe_budget(name)
    assert least("humaneval", "mt_bench") <= recipe_budget("batching")
    assert least("humaneval") <= recipe_budget("default")
