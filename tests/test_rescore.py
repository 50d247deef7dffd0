"""Rescoring: recorded answers are scored again with the cell's own scorer, in place, the
sweep's baseline cache included, without decoding again."""

from __future__ import annotations

import hashlib
import json

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mars_bench.__main__ import CONF_DIR
from mars_bench.bench.baseline_cache import BaselineCache
from mars_bench.bench.records import read_rows
from mars_bench.bench.rescore import main


def test_rescoring_rewrites_stale_scores_in_records_and_the_baseline_cache(tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "turns": ["2+2?"], "reference": ["#### 4"]}) + "\n"
        + json.dumps({"question_id": 2, "turns": ["3+3?"], "reference": ["#### 6"]}) + "\n"
    )  # fmt: skip
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["task=gsm8k", f"task.file={questions}", "task.sources=[file]"])
    cell = tmp_path / "sweep" / "0_gsm8k"
    cell.mkdir(parents=True)
    (cell / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    row = {"task": "gsm8k", "turn": 1, "method": "mars", "status": "ok"}
    rows = [
        {**row, "question_id": 1, "output_text": "so 4", "score": 0.0},
        {**row, "question_id": 2, "output_text": "so 5", "score": 1.0},
        {**row, "question_id": 2, "method": "baseline", "status": "failed", "output_text": "", "score": None},
    ]
    (cell / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    key = hashlib.sha256(b"a baseline").hexdigest()
    BaselineCache(tmp_path / "sweep" / "baselines").put(key, {**rows[0], "method": "baseline"})

    assert main([str(tmp_path / "sweep")]) == 0
    assert [row["score"] for row in read_rows(cell / "records.jsonl")] == [1.0, 0.0, None]
    assert BaselineCache(tmp_path / "sweep" / "baselines").get(key)["score"] == 1.0


def test_a_missing_folder_is_one_clear_line(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "rescore: error: folder" in capsys.readouterr().err
