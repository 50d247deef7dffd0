"""Answers that finish: every record says whether its answer ended on a stop or at the token budget,
every table that shows a score marks one over cut answers, and a score change against the baseline
counts only the prompts where both answers finished (unless asked to count cut ones)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pandas as pd
import pytest

from mars_bench.analysis.__main__ import main
from mars_bench.analysis.gather import gather
from mars_bench.analysis.quality import quality_table
from mars_bench.bench.records import Record
from mars_bench.bench.summary import CUT_MARK, answer_finished, format_table, summarise


def row(question, method, score, stop_reason="stop_token", verifier="mars"):
    """A whole record of the writer's schema, as the app writes it."""
    record = Record(
        cell="c", model="qwen", target="t", draft_model="d", drafter="model", gamma=5, verifier=verifier,
        verifier_setting="theta=0.9" if method != "baseline" else "", temperature=1.0, top_p=1.0, top_k=0,
        task="humaneval", seed=0, max_new_tokens=16, dtype="float32", attn_implementation="sdpa", device_map=None,
        scorer="humaneval", threads=None, batch_size=1, question_id=question, category="code", turn=1, method=method,
        new_tokens=10, steps=3 if method != "baseline" else 9, prefill_s=0.0, decode_s=1.0 if method != "baseline" else 2.0,
        score=score, stop_reason=stop_reason, finished=stop_reason != "max_new_tokens",
    )  # fmt: skip
    return asdict(record)


def run_with_one_cut_answer():
    """Four prompts; the method's answer to prompt 3 was cut at the budget (and scored 0)."""
    rows = []
    for question, (base, method) in enumerate([(1, 1), (1, 0), (0, 1), (1, 0)]):
        rows.append(row(question, "baseline", base))
        rows.append(row(question, "mars", method, stop_reason="max_new_tokens" if question == 3 else "stop_string"))
    return rows


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_record_cut_at_the_budget_is_marked_in_the_summary_table1_and_the_quality_table(tmp_path):
    rows = run_with_one_cut_answer()
    summary = summarise(rows).set_index("method")
    assert (summary.loc["mars", "finished"], summary.loc["mars", "answers"], summary.loc["mars", "scored_cut"]) == (3, 4, 1)
    assert summary.loc["baseline", "finished"] == 4 and summary.loc["baseline", "scored_cut"] == 0
    # the change against the baseline: prompts 0-2 only (both finished); 3 left out
    assert summary.loc["mars", "score_change"] == pytest.approx((0 - 1 + 1) / 3)
    assert (summary.loc["mars", "score_change_prompts"], summary.loc["mars", "score_change_cut"]) == (3, 1)
    counted = summarise(rows, include_cut=True).set_index("method")
    assert counted.loc["mars", "score_change"] == pytest.approx((0 - 1 + 1 - 1) / 4)
    assert counted.loc["mars", "score_change_prompts"] == 4

    terminal = format_table(summarise(rows))
    assert "| 3/4 | 0.500 (1 cut†) |" in terminal and "| 4/4 | 0.750 |" in terminal
    assert "+0.000 [" in terminal and "(3 prompts, 1 cut†)" in terminal
    assert terminal.splitlines()[-1].startswith(f"{CUT_MARK} cut: answers that reached max_new_tokens")

    write_run(tmp_path / "run", rows)
    out = tmp_path / "report"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    table1_md = (out / "table1.md").read_text()
    assert "| humaneval finished_share |" in table1_md.splitlines()[0] and "| 0.75 |" in table1_md
    assert f"1 of 4 answers cut{CUT_MARK}" in table1_md and f"{CUT_MARK} cut: answers that reached" in table1_md
    table1_tex = (out / "table1.tex").read_text()
    assert "1 of 4 answers cut\\textsuperscript{\\dag}" in table1_tex and "finished\\_share" in table1_tex
    quality_md = (out / "quality.md").read_text()
    assert f"| 1{CUT_MARK} |" in quality_md and "leave out every prompt where either answer was cut" in quality_md
    index = (out / "index.md").read_text()
    assert f"Answers: 7 of 8 ended on a stop token or string; 1 were cut at max_new_tokens{CUT_MARK}" in index
    assert "(pareto.png)" in index


def test_the_quality_table_leaves_out_cut_pairs_unless_asked(tmp_path):
    write_run(tmp_path / "run", run_with_one_cut_answer())
    frame = gather([tmp_path / "run"])
    mars = quality_table(frame).set_index("method").loc["mars"]
    assert (mars["prompts"], mars["left_out"], mars["finished"], mars["answers"]) == (3, 1, 3, 4)
    assert mars["difference"] == pytest.approx(0.0)
    counted = quality_table(frame, include_cut=True).set_index("method").loc["mars"]
    assert (counted["prompts"], counted["cut"], counted["left_out"]) == (4, 1, 0)
    assert counted["difference"] == pytest.approx(-1 / 4)


def test_older_records_say_whether_they_finished_through_their_stop_reason():
    frame = pd.DataFrame({"stop_reason": ["stop_token", "max_new_tokens", "stop_string", ""], "finished": [None] * 4})
    assert list(answer_finished(frame)) == [True, False, True, None]


def test_the_accuracy_mode_refuses_a_lossy_verifier_in_one_line_unless_asked(tmp_path):
    from conftest import app, run_config

    from mars_bench.config.checks import check_run_config

    result = app("experiment=accuracy", "verifier=mars", f"output_dir={tmp_path / 'run'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "mars_bench: error: verifier=mars is lossy: accuracy_only scores the target through a lossless verifier "
        "(allowed: exact, rejection); add lossy_accuracy=true to score mars's own answers"
    ]
    assert not (tmp_path / "run").exists()  # refused before any folder is made
    check_run_config(run_config("experiment=accuracy", "verifier=mars", "lossy_accuracy=true"))  # asked: allowed
    accuracy = run_config("experiment=accuracy")
    check_run_config(accuracy)
    assert (accuracy.verifier.name, accuracy.temperature, accuracy.accuracy_only, accuracy.task.num_prompts) == (
        "exact", 0.0, True, None)  # fmt: skip
