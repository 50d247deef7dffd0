"""A drafter tuning is measured in this package's engine: under a backend that is another engine (``backend=vllm``)
the default's tuning is not applied and the run's first line says why, while a drafter key the command line
typed that vLLM cannot run is refused, every such key in one line with the one override that runs. (No vLLM
is needed: everything here is decided before vLLM's installation is checked.)"""

from __future__ import annotations

import pytest
from conftest import app, run_config
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mars_bench.__main__ import CONF_DIR
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import method_spec
from mars_bench.config.run_line import run_line

NO_VLLM = r"^backend=vllm needs vLLM, which "  # the last check: every other one passed
NOT_APPLIED = ("; tuning=cpu (not applied to backend=vllm: drafter tunings are measured in this package's engine; "
               "the drafter's own defaults)")  # fmt: skip


@pytest.fixture(autouse=True)
def no_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_BENCH_VLLM_PYTHON", str(tmp_path / "no-vllm" / "python"))


def typed(*overrides: str):
    """The config ``python -m mars_bench OVERRIDES...`` composes, with Hydra's node that records what was typed
    (as the app's check before the run sees it)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_the_default_config_runs_under_backend_vllm_with_its_tuning_not_applied():
    cfg = run_config("backend=vllm")
    assert cfg.tuned == "qwen2.5-coder-1.5b_model_cpu"  # composed, as under any backend
    with pytest.raises(ValueError, match=NO_VLLM):
        check_run_config(cfg)
    untuned = run_config("tuning=none")
    assert cfg.tuned is None and OmegaConf.to_container(cfg.drafter) == OmegaConf.to_container(untuned.drafter)
    assert run_line(cfg, method_spec(cfg)) == ("mars_bench: model=qwen2.5-coder-1.5b dtype=bfloat16 "
                                               "drafter=model(length=fixed,gamma=5) "
                                               "verifier=mars(theta=0.9,guard=never,correction=residual) task=humaneval "
                                               "temperature=1 batch_size=1" + NOT_APPLIED)  # fmt: skip
    assert cfg.tuning == "cpu"  # the choice as made; the first line says what became of it
    ours = run_config()
    check_run_config(ours)  # this package's engine: the tuning it was measured in applies
    assert ours.tuned == "qwen2.5-coder-1.5b_model_cpu" and ours.drafter.length == "confidence"


def test_a_key_typed_beside_the_tuning_stays_and_the_batching_recipe_checks_under_vllm():
    cfg = typed("backend=vllm", "drafter.gamma=7", "experiment=batching", "batch_size=2")
    with pytest.raises(ValueError, match=NO_VLLM):
        check_run_config(cfg)
    assert (cfg.drafter.gamma, cfg.drafter.length, cfg.drafter.weights, cfg.drafter.guesses) == (7, "fixed", None, 0)


def test_the_precision_a_tuning_table_set_goes_back_to_the_model_options_under_vllm_unless_typed(tmp_path):
    from mars_bench.config.tuning import take_back_tuning

    tuning = tmp_path / "drafter_tuning" / "smollm2-135m_model_cpu.yaml"
    tuning.parent.mkdir()
    tuning.write_text("# @package _global_\ntuned: smollm2-135m_model_cpu\ntuned_for: avx2\n"
                      "cpu_tuning:\n  avx2: {dtype: float32, weights: int8, measured: a}\n"
                      "model:\n  dtype: ${cpu_tuning.${tuned_for}.dtype}\n"
                      "drafter:\n  weights: ${cpu_tuning.${tuned_for}.weights}\n")  # fmt: skip
    planted = ["model=smollm2-135m", "drafter=model", f"hydra.searchpath=[file://{tmp_path}]"]
    assert (typed(*planted).model.dtype, typed(*planted).drafter.weights) == ("float32", "int8")  # this engine: the row
    under_vllm = typed(*planted, "backend=vllm")
    take_back_tuning(under_vllm)
    assert (under_vllm.model.dtype, under_vllm.drafter.weights, under_vllm.tuned) == ("bfloat16", None, None)
    assert under_vllm.tuned_for is None  # the manifest names no row either
    kept = typed(*planted, "backend=vllm", "model.dtype=float32")
    take_back_tuning(kept)
    assert kept.model.dtype == "float32"  # typed: it stays


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # typed as the tuning sets them: typed, so refused
            ["drafter.length=confidence", "drafter.weights=int4", "drafter.guesses=3"],
            "drafter.length=confidence does not run in vLLM, which drafts gamma tokens a step; drafter.weights=int4, "
            "drafter.guesses=3 are not settings of vLLM's drafter: allowed with backend=vllm is drafter.length=fixed "
            "drafter.weights=null drafter.guesses=0",
        ),
        (
            ["drafter.draft_vocab=1000", "model.kernels=onednn"],
            "drafter.draft_vocab=1000 is not a setting of vLLM's drafter; model.kernels=onednn chooses the linear "
            "layers of this package's engine; vLLM runs its own: allowed with backend=vllm is drafter.draft_vocab=null "
            "model.kernels=auto",
        ),
    ],
)
def test_drafter_keys_typed_that_vllm_cannot_run_are_refused_all_in_one_line(overrides, message):
    with pytest.raises(ValueError) as refused:
        check_run_config(typed("backend=vllm", *overrides))
    assert str(refused.value) == message


def test_the_app_refuses_them_in_one_line_before_its_folder_is_made(tmp_path):
    result = app("backend=vllm", "drafter.length=confidence", "drafter.weights=int4", f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr == ("mars_bench: error: drafter.length=confidence does not run in vLLM, which drafts gamma "
                             "tokens a step; drafter.weights=int4 is not a setting of vLLM's drafter: allowed with "
                             "backend=vllm is drafter.length=fixed drafter.weights=null\n")  # fmt: skip


def test_a_cells_written_config_is_the_one_it_runs_under_vllm(tmp_path):
    """A multirun's cell is checked only inside ``run_cell``: the config it writes first (what a rerun resumes)
    already has the tuning taken back, as the run decodes it."""
    from mars_bench.bench.cell import run_cell

    cfg = run_config("backend=vllm", "drafter.gamma=7")  # 7: not the tuning's 20, so it stays
    with pytest.raises(ValueError, match=NO_VLLM):  # the backend's check, after the config is written
        run_cell(cfg, tmp_path / "cell")
    written = OmegaConf.load(tmp_path / "cell" / "config.yaml")
    assert written.tuned is None and written.drafter.length == "fixed" and written.drafter.gamma == 7
