"""The GPU tree check (benchmarks/gpu_tree_check.py) runs end to end on its small config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_tree_check.py"


@pytest.mark.slow
def test_the_tiny_check_reports_every_measurement(tmp_path):
    module = load_script(SCRIPT)
    assert module.main(["--tiny", "--prefix", "16", "--repeats", "1", "--new-tokens", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_tree_check.json").read_text())
    assert report["exact_check"] == {"prompts": 3, "identical": 3}
    measured = report["measured"]
    assert 1 <= measured["tree_nodes"] <= 49
    verifiers = ("exact", "mars", "mars_ref", "rejection", "threshold", "typical")  # the ones that judge trees
    assert set(measured["verify_tree_ms"]) == {f"{name}_{t}" for name in verifiers for t in ("t0", "t1")}
    assert measured["decode"]["mars_eagle3_tree"]["new_tokens"] == 4
    assert "| target forward, 1 token |" in (tmp_path / "gpu_tree_check.md").read_text()
