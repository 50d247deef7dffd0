"""lm-eval runs a local-file task offline through our decoder (``mars-bench-lm-eval``, here
started as ``python -m mars_bench.lm_eval_model``, the same entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_local_gsm8k_task_runs_offline_and_prints_its_table():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = "target=HuggingFaceTB/SmolLM2-135M-Instruct,drafter=layerskip,layers=24,verifier=mars,theta=0.9,temperature=1.0"
    command = [
        sys.executable, "-m", "mars_bench.lm_eval_model", "run", "--model", "mars_bench", "--model_args", args,
        "--include_path", "examples/lm_eval", "--tasks", "gsm8k_local", "--limit", "2",
        "--gen_kwargs", "max_gen_toks=16",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "|gsm8k_local|" in result.stdout and "exact_match" in result.stdout
