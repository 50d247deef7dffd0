"""Shared fixtures: tiny random models (fp32), the real SmolLM2-135M from its mirror, and the
app's config composed in-process."""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)


def _absl_logs_to_the_real_stderr() -> None:
    """absl's log handler (rouge-score logs through it) writes to the sys.stderr of its first use: under
    pytest, one test's capture file. Hydra's logging setup in a later in-process run closes every old
    handler, and absl's close() closes its stream unless it is the current sys.stderr, which would close
    pytest's capture file under the tests that follow. The real stderr is never closed."""
    import absl.logging

    absl.logging.get_absl_handler().python_handler.setStream(sys.__stderr__)


_absl_logs_to_the_real_stderr()

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"needs the MARS prompt files in {SHARED_DATA}; no registry package carries them"
)


def tiny_model(kind: str = "llama", seed: int = 0, layers: int = 4, vocab: int = 96):
    """A randomly initialised causal LM with peaked attention (initializer_range 0.2)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_class(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return model_class(config).eval().requires_grad_(False)


def run_config(*overrides: str):
    """The config ``python -m mars_bench OVERRIDES...`` would run, composed in this process."""
    from hydra import compose, initialize_config_dir

    from mars_bench.__main__ import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def python_m(module: str, *argv: str, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV...`` run in this process: the same entry point, argv, exit status,
    stdout and stderr, without a new interpreter's start (about 5 s of imports on 2 cores) and
    with the models this process has loaded already."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = [module, *argv]
    code: int | str | None = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before; running it is intended
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as exit_:
                code = exit_.code
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], status, out.getvalue(), err.getvalue())


SMOKE = ["experiment=smoke", "task.num_prompts=2", "max_new_tokens=12", "warmup=0", "progress=false"]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m mars_bench experiment=smoke`` (the README's command, 2 prompts, 12 new tokens), run once
    for every test that reads its output: (the finished process, its output folder)."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    return python_m("mars_bench", *SMOKE, f"output_dir={out}", cwd=out.parent), out


@pytest.fixture(scope="session")
def smollm():
    from mars_bench.models import load_model

    return load_model("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32")
