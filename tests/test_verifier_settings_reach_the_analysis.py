"""A verifier the project does not ship, registered here with a setting no other verifier has (``width``),
reaches the records, the sweep folder names, lm-eval's ``model_args`` and every table and figure of the
analysis with no edit anywhere else: the analysis splits and labels its cells by the setting, gives the
setting a column of its own and draws the metrics against it, by the name its records carry."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from conftest import run_config
from omegaconf import OmegaConf

from mars_bench.analysis.__main__ import main
from mars_bench.analysis.cells import Sweep, method_summary, setting_sweeps
from mars_bench.analysis.gather import gather
from mars_bench.analysis.quality import quality_table
from mars_bench.analysis.tables import table1
from mars_bench.bench.folder_names import register_folder_names
from mars_bench.bench.records import read_rows
from mars_bench.verification import base
from mars_bench.verification.strict import RejectionVerifier

WIDE = "wide"  # the test verifier's name
WIDTHS = (1, 2)  # the sweep over its setting


@dataclass(frozen=True)
class WidthSettings:
    """The test verifier's one setting, ``width``: an integer >= 1 (it changes no decision)."""

    width: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"width={self.width!r} is invalid: allowed is an integer >= 1")


class WideVerifier(RejectionVerifier):
    """Rejection sampling under another name, with a setting of its own (lossless, like rejection)."""


@pytest.fixture
def wide(monkeypatch) -> str:
    """``wide`` registered for this test only: the registry is given back as it was afterwards."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    base.register_verifier(WIDE, params=WidthSettings)(WideVerifier)
    return WIDE


def wide_config(tiny_target: Path, width: int):
    """The smoke experiment on the tiny target (conftest.tiny_target), its verifier ``wide`` at ``width``.
    The app's Hydra schema holds the verifiers registered when it was built, so the test composes the
    config as the app does and puts the verifier node in as plain keys."""
    cfg = run_config("experiment=smoke", f"model.target={tiny_target}", "drafter.layers=2", "task.num_prompts=2",
                     "max_new_tokens=8", "warmup=0", "progress=false", "disturbed_load=1000")  # fmt: skip
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["verifier"] = {"name": WIDE, "width": width}
    return OmegaConf.create(plain)


@pytest.mark.slow
def test_a_new_verifier_swept_over_its_own_setting_splits_every_table_by_it(wide, tiny_target, tmp_path):
    from mars_bench.bench.cell import run_cell

    sweep = tmp_path / "sweep"
    for job, width in enumerate(WIDTHS):
        rows = run_cell(wide_config(tiny_target, width), sweep / f"{job}_humaneval_wide_width{width}_t1.0")
        assert {row["status"] for row in rows} == {"ok"}
    written = [row for job, width in enumerate(WIDTHS)
               for row in read_rows(sweep / f"{job}_humaneval_wide_width{width}_t1.0" / "records.jsonl")]  # fmt: skip
    assert {(row["method"], row["verifier_setting"]) for row in written} == {
        (method, f"width={width}") for method in ("baseline", WIDE) for width in WIDTHS}  # fmt: skip
    frame = gather([sweep]).assign(disturbed=False)  # this machine is shared: timing is not what is tested
    summary = method_summary(frame).set_index("label")
    labels = [f"{WIDE} (width={width})" for width in WIDTHS]
    assert sorted(summary.index) == labels and summary["width"].to_dict() == dict(zip(labels, WIDTHS))
    assert list(summary.columns[summary.columns.get_loc("verifier") :][:3]) == ["verifier", "width", "verifier_setting"]
    assert (summary["prompts"] == 2).all() and summary["speedup"].notna().all()
    assert sorted(table1(frame, summary.reset_index()).index.get_level_values("method")) == labels
    assert sorted(quality_table(frame, include_cut=True)["method"]) == labels
    assert setting_sweeps(summary.reset_index()) == [Sweep(WIDE, "width")]
    out = tmp_path / "analysis"
    assert main([str(sweep), "--out", str(out), "--include-disturbed"]) == 0
    settings = pd.read_csv(out / "settings.csv")
    assert settings["label"].tolist() == labels and settings["width"].tolist() == list(WIDTHS)
    assert "(threshold_ablation.png)" in (out / "index.md").read_text()  # drawn against width


def hand_written(folder: Path, settings: dict[str, str], verifier: str = WIDE) -> None:
    """A run folder per setting (name -> ``verifier_setting``), two prompts each, written as the app writes
    rows of schema 10: the method twice as fast as its baseline, each setting with its own score."""
    for index, (name, setting) in enumerate(settings.items()):
        rows = [{"cell": name, "model": "qwen", "drafter": "model", "task": "humaneval", "temperature": 1.0,
                 "verifier": verifier, "verifier_setting": setting, "question_id": question, "turn": 1, "method": method,
                 "status": "ok", "new_tokens": 10, "prefill_s": 0.0, "decode_s": 2.0 if method == "baseline" else 1.0,
                 "steps": 9 if method == "baseline" else 3, "score": float(index % 2), "finished": True,
                 "schema_version": 10}
                for question in (0, 1) for method in ("baseline", verifier)]  # fmt: skip
        (folder / name).mkdir(parents=True)
        (folder / name / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_setting_that_varies_names_the_labels_the_columns_and_the_sweep(tmp_path):
    hand_written(tmp_path, {"a": "width=1,mode=fast", "b": "width=2,mode=fast", "c": "width=4,mode=fast"})
    summary = method_summary(gather([tmp_path]))
    assert summary["label"].tolist() == ["wide (width=1)", "wide (width=2)", "wide (width=4)"]
    assert summary["width"].tolist() == [1, 2, 4] and "mode" not in summary  # the same in every cell
    sweep = setting_sweeps(summary)
    assert sweep == [Sweep(WIDE, "width")] and sweep[0].axis == "wide: width"
    assert sweep[0].values(summary).tolist() == [1.0, 2.0, 4.0]


@pytest.mark.parametrize(("settings", "why"), [
    ({"a": "width=1,mode=fast", "b": "width=2,mode=slow"}, "two settings differ"),
    ({"a": "mode=fast", "b": "mode=slow"}, "the setting is no number"),
    ({"a": "width=1", "b": "width=None"}, "one number only"),
    ({"a": "width=2"}, "one cell"),
])  # fmt: skip
def test_cells_that_differ_in_other_than_one_number_are_no_sweep(tmp_path, settings, why):
    hand_written(tmp_path, settings)
    assert setting_sweeps(method_summary(gather([tmp_path]))) == [], why


@pytest.mark.slow  # over a second
def test_the_threshold_ablation_and_the_pareto_front_draw_any_verifiers_sweep(tmp_path):
    from mars_bench.analysis.figures import pareto, threshold_ablation

    hand_written(tmp_path / "wide", {"a": "width=1", "b": "width=2"})
    hand_written(tmp_path / "other", {"c": "depth=3", "d": "depth=5"}, verifier="deep")
    summary = method_summary(gather([tmp_path]))
    assert [sweep.axis for sweep in setting_sweeps(summary)] == ["deep: depth", "wide: width"]
    assert threshold_ablation(summary, tmp_path / "ablation.png").is_file()  # a column of panels per sweep
    assert pareto(summary, tmp_path / "pareto.png").is_file()


def test_a_sweep_folder_is_named_by_the_verifiers_overridden_settings(wide):
    register_folder_names()
    root = {"verifier": {"name": WIDE, "width": 2}, "hydra": {"overrides": {"task": ["task=gsm8k", "verifier.width=2"]}},
            "subdir": "${verifier_label:}"}  # fmt: skip
    assert OmegaConf.create(root).subdir == "wide_width2"
    root["hydra"]["overrides"]["task"] = ["task=gsm8k"]  # at its configured setting: the bare name
    assert OmegaConf.create(root).subdir == WIDE


def test_lm_evals_model_args_take_a_new_verifiers_setting_by_its_name(wide):
    from mars_bench.lm_eval_model import lm_eval_spec

    spec = lm_eval_spec("lookup", WIDE, {"width": 3})
    assert spec.verifier == WIDE and spec.verifier_settings == WidthSettings(3)
    with pytest.raises(ValueError, match="unknown model_args wdth for drafter=lookup, verifier=wide: .*width"):
        lm_eval_spec("lookup", WIDE, {"wdth": 3})
