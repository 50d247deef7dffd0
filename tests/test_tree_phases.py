"""The tree phase benchmark (benchmarks/tree_phases.py) runs its tiny EAGLE-3 case end to end."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tree_phases.py"


def test_the_eagle3_case_reports_draft_and_verify_ms_per_step(tmp_path, capsys):
    module = load_script(SCRIPT)
    out = tmp_path / "phases.json"
    argv = ["--cases", "eagle3", "--prompts", "1", "--max-new-tokens", "6", "--repeats", "1", "--out", str(out)]
    assert module.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["code"]["path"] == str(SCRIPT.parents[1])
    methods = report["cases"]["eagle3"]
    assert set(methods) == {"exact_t0", "mars_t1"}
    for row in methods.values():
        assert row["steps"] >= 1 and row["new_tokens"] == 6 and row["drafted_per_step"] > 0
        assert row["ms_per_step"]["draft"] > 0 and row["ms_per_step"]["verify"] > 0
    assert "| eagle3 | exact_t0 |" in capsys.readouterr().out
