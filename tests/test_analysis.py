"""analysis/: Table 1 cells equal hand-computed values from synthetic records; empty input
gives a clear message; the package never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from analysis.__main__ import main
from analysis.gather import NoRecordsError, gather
from analysis.tables import table1, to_latex, to_markdown


def record(question, method, tokens, seconds, steps, *, task="humaneval", verifier="mars", theta=0.9, status="ok"):
    return {
        "cell": "c", "model": "qwen", "drafter": "model", "task": task, "verifier": verifier, "theta": theta,
        "question_id": question, "turn": 1, "method": method, "status": status, "new_tokens": tokens,
        "prefill_s": 0.0, "decode_s": seconds, "steps": steps,
    }  # fmt: skip


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def sweep(tmp_path):
    write_run(
        tmp_path / "sweep" / "0",
        [record(0, "baseline", 100, 10.0, 99), record(0, "mars", 100, 4.0, 24), record(1, "baseline", 51, 5.0, 50),
         record(1, "mars", 51, 3.0, 10), record(2, "mars", 9, 9.0, 8, status="failed")],
    )  # fmt: skip
    write_run(
        tmp_path / "sweep" / "1",
        [record(0, "baseline", 80, 8.0, 79, task="gsm8k"), record(0, "mars", 80, 2.0, 19, task="gsm8k")],
    )
    return tmp_path / "sweep"


def test_table1_cells_equal_hand_computed_values(sweep):
    table = table1(gather([sweep]))
    row = table.loc[("qwen", "model", "mars (theta 0.9)")]
    assert row[("humaneval", "speedup")] == pytest.approx((151 / 7.0) / (151 / 15.0))
    assert row[("humaneval", "tau")] == pytest.approx((99 + 50) / (24 + 10))  # the failed row is left out
    assert row[("gsm8k", "speedup")] == pytest.approx(4.0)
    assert row[("Mean", "speedup")] == pytest.approx(((151 / 7.0) / (151 / 15.0) + 4.0) / 2)
    assert "| qwen | model | mars (theta 0.9) |" in to_markdown(table)
    latex = to_latex(table)
    assert "\\toprule" in latex and "\\bottomrule" in latex


def test_the_command_writes_tables_and_an_index(sweep, tmp_path):
    out = tmp_path / "out"
    assert main([str(sweep), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"records.parquet", "table1.md", "table1.tex", "index.md"}
    assert len(pd.read_parquet(out / "records.parquet")) == 7


def test_an_empty_or_missing_sweep_gives_a_clear_message(tmp_path, capsys):
    with pytest.raises(NoRecordsError, match="no records.jsonl with finished rows below"):
        gather([tmp_path])
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "analysis: error: folder" in capsys.readouterr().err


def test_a_sweep_without_baselines_says_so(tmp_path):
    write_run(tmp_path / "half", [record(0, "mars", 10, 1.0, 3)])
    with pytest.raises(ValueError, match="no run has both baseline and method rows"):
        table1(gather([tmp_path]))


def test_analysis_never_imports_torch():
    code = "import sys, analysis.__main__, analysis.tables; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
