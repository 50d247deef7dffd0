"""The Hydra app: every config option composes; bad input fails at start with one clear line;
a smoke run writes records, manifest, config and summary. (Sweeps: test_readme.py; a killed
run's resume: test_reliability.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import SMOKE, app, run_config
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import OmegaConf

import mars_bench
from mars_bench.__main__ import CONF_DIR
from mars_bench.bench.cell import run_cell
from mars_bench.bench.manifest import source_hash
from mars_bench.bench.records import Record, read_rows
from mars_bench.common.cpu import cpu_kind
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import method_spec
from mars_bench.tasks import QuestionFileError

GROUPS = {
    group: sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
    for group in ("model", "drafter", "verifier", "task", "experiment", "tuning")
}


@pytest.mark.parametrize(("group", "option"), [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if group == "model" and option == "smollm2-135m":
        overrides.append("drafter=layerskip")  # it has no separate draft model
    if group == "drafter" and option == "eagle3":
        overrides.append("model=llama3.1-8b")  # a target with a published EAGLE-3 head
    cfg = run_config(*overrides)
    check_run_config(cfg)
    if group == "tuning":
        assert cfg.tuning == option
    elif group != "experiment":
        assert cfg[group].name == option


def test_each_shipped_plugin_option_is_a_registered_plugin_with_its_own_defaults():
    from mars_bench.drafting import available_drafters
    from mars_bench.verification import available_verifiers

    assert set(GROUPS["drafter"]) <= set(available_drafters())
    assert set(GROUPS["verifier"]) <= set(available_verifiers())
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        tree = compose(config_name="config", overrides=["drafter=model_tree"])
        eagle = compose(config_name="config", overrides=["drafter=eagle3", "model=llama3.1-8b"])
        chain = compose(config_name="config", overrides=["drafter=model", "drafter.length=schedule", "drafter.max_gamma=9",
                                                         "tuning=none"])  # fmt: skip
    tree, eagle, chain = method_spec(tree), method_spec(eagle), method_spec(chain)
    assert tree.drafter_setting == "gamma=5,top_k=3,tree_tokens=16"
    assert eagle.drafter_setting == "gamma=7,top_k=10,tree_tokens=50"  # the same keys, the drafter's own defaults
    assert chain.drafter_setting == "gamma=5"  # the draft-length policy is a setting column of its own
    assert (chain.max_draft_depth, tree.max_draft_depth) == (9, 15)  # a tree: its node budget


AS_LOADED = {"gamma": 5, "length": "fixed", "min_confidence": 0.4, "draft_vocab": None, "weights": None, "guesses": 0}
TUNED_PAIR = {"gamma": 20, "length": "confidence", "min_confidence": 0.6, "draft_vocab": 32768, "weights": "int4",
              "guesses": 3}  # conf/drafter_tuning/qwen2.5-coder-1.5b_model_cpu.yaml


def _drafter_keys(cfg) -> dict:
    return {key: cfg.drafter[key] for key in AS_LOADED}


@pytest.mark.slow
def test_the_embedded_pair_drafts_with_its_measured_best_settings_and_a_command_line_key_wins():
    assert _drafter_keys(run_config()) == TUNED_PAIR
    assert _drafter_keys(run_config("drafter.length=fixed")) == {**TUNED_PAIR, "length": "fixed"}
    assert _drafter_keys(run_config("drafter.weights=null", "drafter.gamma=3")) == {**TUNED_PAIR, "weights": None, "gamma": 3}
    assert _drafter_keys(run_config("tuning=none")) == AS_LOADED  # the drafter as loaded, gamma fixed
    assert _drafter_keys(run_config("model=qwen3-8b")) == AS_LOADED  # another pair: nothing measured, nothing tuned
    tree = run_config("drafter=model_tree")  # the tuning is the chain drafter's: the tree keeps its own defaults
    assert (tree.drafter.length, tree.drafter.draft_vocab, tree.drafter.weights) == ("fixed", None, None)
    check_run_config(run_config())


@pytest.mark.parametrize("experiment", ["threshold_ablation", "table1", "zoo", "paper"])
def test_the_paper_experiments_run_the_drafter_as_loaded_with_gamma_fixed(experiment):
    assert _drafter_keys(run_config(f"experiment={experiment}")) == AS_LOADED
    assert _drafter_keys(run_config(f"experiment={experiment}", "drafter.weights=int8"))["weights"] == "int8"


def test_each_drafter_tuning_names_a_model_a_drafter_and_a_tuning_option_and_sets_only_that_drafters_keys():
    from mars_bench.config.schema import DrafterCommon
    from mars_bench.drafting import drafter_settings

    tunings = sorted((Path(CONF_DIR) / "drafter_tuning").glob("*.yaml"))
    assert tunings
    for tuning in tunings:
        rest, _, choice = tuning.stem.rpartition("_")
        model, _, drafter = rest.rpartition("_")
        assert model in GROUPS["model"] and drafter in GROUPS["drafter"] and choice in GROUPS["tuning"], tuning.name
        content = OmegaConf.to_container(OmegaConf.load(tuning), resolve=False)  # a table's rows are interpolations
        per_kind = {"tuned_for", "cpu_tuning", "model"}  # a table per CPU kind: the precision, beside the draft weights
        assert set(content) - per_kind == {"tuned", "drafter"} and content["tuned"] == tuning.stem, tuning.name
        assert set(content.get("model", {})) <= {"dtype"}, tuning.name
        allowed = {item.name for item in fields(DrafterCommon)} | {item.name for item in fields(drafter_settings(drafter))}
        assert set(content["drafter"]) and set(content["drafter"]) <= allowed - {"name"}, tuning.name
        cfg = run_config(f"model={model}", f"drafter={drafter}", f"tuning={choice}")
        written = OmegaConf.to_container(cfg.drafter, resolve=False)
        assert cfg.tuned == tuning.stem and all(written[key] == value for key, value in content["drafter"].items())
        check_run_config(cfg)
        untuned = run_config(f"model={model}", f"drafter={drafter}", "tuning=none")
        assert untuned.tuned is None and any(untuned.drafter[key] != cfg.drafter[key] for key in content["drafter"])


def test_the_same_command_runs_the_same_method_on_every_machine():
    for placement in ("cuda", "cpu", "auto"):
        cfg = run_config(f"model.device_map={placement}")
        assert _drafter_keys(cfg) == TUNED_PAIR and cfg.tuning == "cpu", placement
        check_run_config(cfg)  # no GPU is needed to compose and check it
        assert _drafter_keys(run_config(f"model.device_map={placement}", "tuning=none")) == AS_LOADED


def test_the_tuning_takes_the_row_of_its_cpu_kind_and_a_typed_value_wins(tmp_path):
    from mars_bench.common.cpu import CPU_KINDS, OTHER_KIND
    from mars_bench.config.overrides import check_tuning_row

    assert [cpu_kind(frozenset(flags)) for flags in (["avx2", "avx512_bf16", "amx_bf16"], ["avx2", "avx512_bf16"],
                                                     ["avx2"], ["neon"])] == ["amx", "avx512_bf16", "avx2", "other"]  # fmt: skip
    cfg = run_config()
    assert cfg.tuned_for == cpu_kind() and set(cfg.cpu_tuning) == {*CPU_KINDS, OTHER_KIND}
    assert all(row.measured for row in cfg.cpu_tuning.values())  # each row names what chose it
    assert run_config("model.device_map=cuda").tuned_for == OTHER_KIND
    # a tuning whose rows differ: each kind's row sets the precision and the draft weights; typed values win
    tuning = tmp_path / "drafter_tuning" / "smollm2-135m_model_cpu.yaml"
    tuning.parent.mkdir()
    tuning.write_text("# @package _global_\ntuned: smollm2-135m_model_cpu\ntuned_for: ${placement_kind:${model.device_map}}\n"
                      "cpu_tuning:\n  amx: {dtype: bfloat16, weights: int4, measured: a}\n"
                      "  avx512_bf16: {dtype: bfloat16, weights: int8, measured: b}\n"
                      "  avx2: {dtype: float32, weights: null, measured: c}\n  other: {dtype: bfloat16, measured: d}\n"
                      "model:\n  dtype: ${cpu_tuning.${tuned_for}.dtype}\n"
                      "drafter:\n  weights: ${cpu_tuning.${tuned_for}.weights}\n")  # fmt: skip
    planted = ["model=smollm2-135m", "drafter=model", f"hydra.searchpath=[file://{tmp_path}]"]
    for kind, dtype, weights in (("amx", "bfloat16", "int4"), ("avx512_bf16", "bfloat16", "int8"), ("avx2", "float32", None)):
        row = run_config(*planted, f"tuned_for={kind}")
        assert (row.model.dtype, row.drafter.weights) == (dtype, weights), kind
    typed = run_config(*planted, "tuned_for=avx2", "model.dtype=bfloat16", "drafter.weights=int8")
    assert (typed.model.dtype, typed.drafter.weights) == ("bfloat16", "int8")
    with pytest.raises(ValueError, match=r"^tuned_for=avx9 is invalid: allowed is one of amx, avx512_bf16, avx2, other$"):
        check_tuning_row(["tuned_for=avx9"])


def test_the_first_line_names_the_method_and_its_tuning():
    from mars_bench.config.run_line import run_line

    def first_line(*overrides: str) -> str:
        cfg = run_config(*overrides)
        return run_line(cfg, method_spec(cfg))

    assert first_line() == (
        "mars_bench: model=qwen2.5-coder-1.5b dtype=bfloat16 drafter=model(length=confidence,gamma=20,draft_vocab=32768,"
        "context_vocab=True,weights=int4,guesses=3) verifier=mars(theta=0.9,guard=never,correction=residual) "
        f"task=humaneval temperature=1 batch_size=1; tuning=cpu for CPU kind {cpu_kind()} "
        "(conf/drafter_tuning/qwen2.5-coder-1.5b_model_cpu.yaml: dtype=bfloat16, weights=int4)"
    )
    assert first_line("tuning=none").endswith("; tuning=none (the drafter's own defaults)")
    assert first_line("drafter=lookup").endswith(
        "; tuning=cpu (none measured for model=qwen2.5-coder-1.5b drafter=lookup: its own defaults)"
    )


def test_the_tuned_default_runs_at_batch_size_above_1_as_typed_with_every_setting_it_names():
    from mars_bench.config.method import method_spec
    from mars_bench.config.run_line import run_line

    cfg = run_config("batch_size=4")
    check_run_config(cfg)  # guesses and context tokens draft per row: nothing is refused, nothing dropped
    assert _drafter_keys(cfg) == TUNED_PAIR and cfg.drafter.context_vocab
    settings = method_spec(cfg).drafter_settings
    assert settings.guesses == 3 and settings.context_vocab  # what runs is what the command says
    line = run_line(cfg, method_spec(cfg))
    assert "context_vocab=True,weights=int4,guesses=3" in line and "batch_size=4" in line
    batching = run_config("experiment=batching", "batch_size=4")  # the recipe drafts as its committed run drafted
    check_run_config(batching)
    assert _drafter_keys(batching) == {**TUNED_PAIR, "guesses": 0}


@pytest.mark.slow
def test_a_drafter_tuning_reaches_the_records_of_a_real_run(tmp_path, tiny_target):
    tuning = tmp_path / "conf" / "drafter_tuning" / "smollm2-135m_model_cpu.yaml"
    tuning.parent.mkdir(parents=True)
    tuning.write_text("# @package _global_\ntuned: smollm2-135m_model_cpu\ndrafter:\n  length: confidence\n  weights: int8\n")
    # the model option smollm2-135m, on the tiny target drafting for itself (conftest.tiny_target): the tuning is the option's
    settings = ["drafter=model", f"model.target={tiny_target}", f"model.draft_model={tiny_target}"]
    done = app(*SMOKE, *settings, f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("mars_bench: model=smollm2-135m dtype=bfloat16 drafter=model(length=confidence,gamma=5,"
                            "weights=int8) ")  # fmt: skip
    assert first.endswith("; tuning=cpu (conf/drafter_tuning/smollm2-135m_model_cpu.yaml)")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["config"]["tuning"], manifest["config"]["tuned"]) == ("cpu", "smollm2-135m_model_cpu")
    method = [row for row in read_rows(tmp_path / "run" / "records.jsonl") if row["method"] != "baseline"]
    assert method and all(row["drafter_setting"] == "gamma=5,weights=int8" for row in method)
    assert all(row["draft_length"] == "confidence" and row["status"] == "ok" for row in method)


def test_a_misspelt_plugin_key_is_refused_with_the_allowed_keys():
    from mars_bench.config.overrides import check_override_keys

    with pytest.raises(ValueError, match=r"drafter.topk is not a drafter setting: allowed are .*model_tree: .*top_k tree_tokens"):
        check_override_keys(["drafter=model_tree", "drafter.topk=3"])
    with pytest.raises(ValueError, match=r"verifier.thet is not a verifier setting: allowed are .*mars: correction entropy_gate"):
        check_override_keys(["+verifier.thet=0.9"])
    declared = ["drafter=model_tree", "drafter.top_k=3", "verifier.theta=0.8,0.9", "hydra.sweep.dir=x"]
    check_override_keys(declared)  # declared keys pass


def test_a_plugin_takes_only_its_own_keys():
    from mars_bench.config.overrides import check_override_keys

    with pytest.raises(ValueError, match=r"^verifier.theta is not a setting of verifier=exact: verifier=exact takes no settings"):
        check_override_keys(["verifier=exact", "verifier.theta=0.5"])
    with pytest.raises(ValueError, match=r"^drafter.top_k is not a setting of drafter=model: allowed are gamma, length"):
        check_override_keys(["drafter.top_k=3"])  # the default drafter, model, drafts chains
    with pytest.raises(ValueError, match=r"verifier=rejection takes no settings"):
        check_override_keys(["experiment=zoo", "verifier.theta=0.5"])  # the experiment's verifier
    with pytest.raises(ValueError, match=r"verifier=exact"):
        check_override_keys(["-m", "verifier=mars,exact", "verifier.theta=0.5"])  # every verifier a sweep runs
    with pytest.raises(ConfigCompositionException, match="Could not override 'verifier.theta'"):
        run_config("verifier=exact", "verifier.theta=0.5")  # and the composed config has no such key either
    assert "theta" not in run_config("verifier=exact").verifier


@pytest.mark.slow
def test_the_app_refuses_a_misspelt_drafter_key_in_one_line(app_process):
    result = app_process("drafter.topk=3", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "mars_bench: error: drafter.topk is not a drafter setting: allowed are name, gamma, length, max_gamma, min_confidence, "
        "draft_cost; drafter settings: eagle3: top_k tree_tokens; layerskip: layers; lookup: max_ngram min_ngram; "
        "model: context_vocab draft_vocab guesses token_counts weights; model_tree: context_vocab draft_vocab token_counts top_k "
        "tree_tokens weights"
    ]


def test_the_shipped_groups_cover_the_paper():
    assert {
        "qwen2.5-coder-1.5b",
        "smollm2-135m",
        "llama3.1-8b",
        "llama3.3-70b",
        "vicuna-13b",
        "qwen3-8b",
        "qwen3-32b",
        "qwen3-235b-a22b",
    } <= set(GROUPS["model"])
    assert {"exact", "rejection", "mars", "mars_ref", "typical"} <= set(GROUPS["verifier"])
    assert {"mt_bench", "humaneval", "gsm8k", "alpaca", "cnndm", "qa", "wmt19", "aime2025"} <= set(GROUPS["task"])
    assert {"model", "layerskip", "lookup", "none"} <= set(GROUPS["drafter"])
    assert {"smoke", "default", "paper"} <= set(GROUPS["experiment"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["max_new_tokens=many"], "max_new_tokens"),
        (["max_new_tokn=5"], "Could not override 'max_new_tokn'"),
    ],
)
def test_a_misspelt_key_or_a_mistyped_value_fails_as_the_config_composes(overrides, message):
    with pytest.raises(HydraException) as error:
        run_config(*overrides)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["verifier.theta=1.5"], "theta=1.5 is invalid"),
        (["temperature=-1"], "temperature=-1.0 is invalid"),
        (["top_p=0"], "top_p=0.0 is invalid"),
        (["model=smollm2-135m"], "drafter=model needs model.draft_model"),
        (["drafter.length=wild"], "drafter.length='wild' is invalid: allowed are fixed, schedule, confidence, gain"),
        (["shadow=[strict]"], "shadow verifier 'strict' is unknown: allowed are bild, cascade, exact, "),
    ],
)
def test_a_value_out_of_range_fails_with_one_line_before_any_model_loads(overrides, message):
    cfg = run_config(*overrides)
    with pytest.raises(ValueError) as error:
        check_run_config(cfg)  # the first thing a cell does
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_unknown_config_option_stops_the_app_with_one_line_and_no_traceback():
    result = app("verifier=strict")
    assert result.returncode == 2
    expected = "mars_bench: error: verifier=strict is not a verifier option: allowed are bild, cascade, exact, "
    assert result.stderr.startswith(expected)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_an_unwritable_output_folder_stops_the_app_with_one_line_and_no_traceback():
    result = app("output_dir=/proc/mars_bench_out")
    assert result.returncode == 2
    assert result.stderr.startswith("mars_bench: error: output folder '/proc/mars_bench_out' cannot be written")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_malformed_prompt_file_names_file_and_line(tmp_path):
    bad = tmp_path / "questions.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2, "turns": ["oops"\n')
    with pytest.raises(QuestionFileError, match=re.escape(f"{bad}:2: bad JSON")):
        run_cell(run_config(*SMOKE, f"task.file={bad}"), tmp_path / "out")  # the app prints it and exits 2, as for any cell error


def test_the_app_builds_a_cells_method_once(tmp_path, monkeypatch, capsys):
    """The run's first line, its cell and the cell's failure row share one method, built from the config once
    (here the cell stops at its prompt file, after its check, and the app writes the failure row)."""
    from mars_bench.__main__ import run
    from mars_bench.common.settings import setting_string
    from mars_bench.method import MethodSpec

    built: list[MethodSpec] = []
    create = MethodSpec.create.__func__

    def counted(cls, *args, **kwargs):
        built.append(create(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(MethodSpec, "create", classmethod(counted))
    bad = tmp_path / "questions.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["oops"\n')
    with pytest.raises(SystemExit):
        run(run_config(*SMOKE, f"task.file={bad}"), tmp_path / "out", "cell", multirun=False)
    assert len(built) == 1  # before: the first line, the check, and the failure row each built their own
    (row,) = read_rows(tmp_path / "out" / "records.jsonl")
    assert row["status"] == "failed" and row["verifier_setting"] == setting_string(built[0].verifier_values) != ""
    assert capsys.readouterr().out.startswith("mars_bench: model=smollm2-135m dtype=bfloat16 drafter=layerskip(")


@pytest.fixture
def smoke(smoke_run) -> tuple[subprocess.CompletedProcess, Path]:
    """The README's smoke command, run once per session (conftest), read by the tests below."""
    return smoke_run


@pytest.mark.slow
def test_smoke_exits_zero_and_prints_the_summary(smoke):
    result, _ = smoke
    assert result.returncode == 0, result.stderr
    assert "| baseline |" in result.stdout and "| mars |" in result.stdout


@pytest.mark.slow
def test_smoke_records_carry_every_field_and_consistent_counts(smoke):
    _, out = smoke
    rows = list(read_rows(out / "records.jsonl"))
    assert len(rows) == 4  # 2 prompts x (baseline, mars)
    assert set(rows[0]) == {f.name for f in fields(Record)}
    for row in rows:
        assert row["new_tokens"] == len(row["output_ids"]) <= 12
        assert row["tau"] > 0 and row["decode_s"] > 0 and row["prefill_s"] > 0
        assert row["verified_positions"] == len(row["reasons"])
        assert all(len(values) == len(row["reasons"]) for values in row["rule_values"].values())
        assert set(row["rule_values"]) == ({"margin"} if row["method"] == "mars" else set())  # what mars declares
    baseline = next(r for r in rows if r["method"] == "baseline")
    assert baseline["tau"] == 1.0 and baseline["agreement"] is None


@pytest.mark.slow
def test_smoke_compares_every_method_row_with_its_baseline(smoke):
    _, out = smoke
    rows = list(read_rows(out / "records.jsonl"))
    # the method ran first on the second question, yet every method row is compared with its baseline
    assert all(0 <= r["agreement"] <= 1 and 0 <= r["baseline_rouge_l"] <= 1 for r in rows if r["method"] == "mars")


@pytest.mark.slow
def test_smoke_manifest_names_packages_models_seeds_and_methods(smoke):
    _, out = smoke
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"packages", "git", "source_sha256", "cpu", "models", "seeds", "config"} <= set(manifest)
    assert manifest["models"]["target"]["dtype"] == "bfloat16"
    assert manifest["methods"]["mars"]["verifier"] == {"name": "mars", "theta": 0.9, "guard": "never", "correction": "residual"}
    assert manifest["methods"]["mars"]["drafter"]["name"] == "layerskip" and manifest["methods"]["baseline"]["drafter"] is None


@pytest.mark.slow
def test_smoke_writes_the_summary_and_the_resolved_config(smoke):
    _, out = smoke
    assert (out / "summary.csv").read_text().startswith("cell,method")
    assert "max_new_tokens: 12" in (out / "config.yaml").read_text()


def test_the_source_hash_names_the_code_and_configs_that_ran(tmp_path):
    package, conf = tmp_path / "checkout" / "mars_bench", tmp_path / "checkout" / "conf"
    for path, text in {package / "a.py": "x = 1", conf / "b.yaml": "k: 1", package / "notes.txt": "n"}.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    before = source_hash(package, conf)
    (package / "notes.txt").write_text("other")  # neither code nor config
    assert source_hash(package, conf) == before
    (conf / "b.yaml").write_text("k: 2")
    assert source_hash(package, conf) != before
    (conf / "b.yaml").write_text("k: 1")
    (package / "a.py").write_text("x = 2")
    assert source_hash(package, conf) != before


def test_the_source_hash_is_the_same_for_a_copy_and_for_a_wheel_of_this_checkout(tmp_path):
    skip = shutil.ignore_patterns("__pycache__")
    copy = tmp_path / "copy"
    shutil.copytree(Path(mars_bench.__file__).parent, copy / "mars_bench", ignore=skip)
    shutil.copytree(CONF_DIR, copy / "conf", ignore=skip)
    wheel = tmp_path / "site-packages" / "mars_bench"  # a wheel carries conf/ and analysis/ inside the package
    shutil.copytree(copy / "mars_bench", wheel)
    shutil.copytree(copy / "conf", wheel / "conf")
    (wheel / "analysis").mkdir()
    (wheel / "analysis" / "tables.py").write_text("x = 1")  # the analysis runs no model: left out
    checkout = source_hash()
    assert source_hash(copy / "mars_bench", copy / "conf") == checkout  # where the tree lies does not count
    assert source_hash(wheel, wheel / "conf") == checkout


@pytest.mark.slow
def test_a_tree_drafter_with_a_separate_model_runs_a_cell_losslessly(tmp_path, tiny_target):
    """The tiny target (conftest.tiny_target) named as its own draft model."""
    out = tmp_path / "tree"
    cfg = run_config("model=smollm2-135m", f"model.target={tiny_target}", "drafter=model_tree",
                     f"model.draft_model={tiny_target}", "task.num_prompts=2", "max_new_tokens=12", "warmup=0",
                     "progress=false", "temperature=0", "verifier=exact", "model.dtype=float32")  # fmt: skip
    rows = run_cell(cfg, out)
    assert [row["status"] for row in rows] == ["ok"] * 4
    assert all(row["agreement"] == 1.0 and row["tau"] > 1 for row in rows if row["method"] == "exact")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["methods"]["exact"]["drafter"] == {"name": "model_tree", "top_k": 3, "tree_tokens": 16}


def test_a_draft_model_equal_to_the_target_is_loaded_once(monkeypatch):
    """The target's and the drafter's loads are one cache entry when they name the same weights and placement."""
    from mars_bench.backends import hf as cell  # where the transformers backend loads its models

    loads = []

    def fake_load(name, **options):
        loads.append((name, options))
        tokenizer = type("Tokenizer", (), {"get_vocab": lambda self: {"a": 0}})()
        return type("Loaded", (), {"model": object(), "tokenizer": tokenizer})()

    monkeypatch.setattr(cell, "load_model", fake_load)
    cell.forget_loaded_models()
    try:
        cfg = run_config("model=smollm2-135m", "drafter=model", "model.draft_model=HuggingFaceTB/SmolLM2-135M-Instruct")
        models = cell.load_models(cfg)
    finally:
        cell.forget_loaded_models()
    assert models["drafter"] is models["target"]
    assert [name for name, _ in loads] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]


NO_BF16_CPU = {"model": "a CPU", "cores": 2, "avx512_bf16": False, "amx_bf16": False, "native_bf16": False}


def test_bf16_on_a_cpu_without_native_bf16_is_named_in_one_line():
    from mars_bench.bench.manifest import BF16_FLAGS, cpu_description, emulated_bf16_warning

    line = emulated_bf16_warning("bfloat16", None, NO_BF16_CPU)
    assert line.startswith("dtype=bfloat16 on a CPU without native bf16 (a CPU: ") and "\n" not in line
    assert "model.kernels=auto keeps one-token forwards in bf16" in line and all(flag in line for flag in BF16_FLAGS)
    assert "float32" not in line.split("float32 copies")[0]  # no advice to run float32: bf16 ran faster (docs/performance.md)
    stock = emulated_bf16_warning("bfloat16", None, NO_BF16_CPU, kernels="stock")
    assert "model.kernels=stock leaves them so" in stock and "\n" not in stock
    assert emulated_bf16_warning("bfloat16", "cpu", NO_BF16_CPU) == line
    native = {**NO_BF16_CPU, "amx_bf16": True, "native_bf16": True}
    unknown = {**NO_BF16_CPU, "avx512_bf16": None, "amx_bf16": None, "native_bf16": None}
    assert emulated_bf16_warning("bfloat16", None, native) is None  # the CPU multiplies bf16 itself
    assert emulated_bf16_warning("bfloat16", None, unknown) is None  # no /proc/cpuinfo: not known, not said
    assert emulated_bf16_warning("float32", None, NO_BF16_CPU) is None
    assert emulated_bf16_warning("bfloat16", "cuda", NO_BF16_CPU) is None  # the models are not on the CPU
    cpu = cpu_description()  # this machine's, read from /proc/cpuinfo
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].splitlines()[0].split()
    assert cpu["native_bf16"] == any(flag in flags for flag in BF16_FLAGS)


@pytest.mark.slow
def test_a_run_on_a_cpu_without_native_bf16_warns_and_still_runs(tmp_path, tiny_target, monkeypatch):
    from mars_bench.bench import manifest

    monkeypatch.setattr(manifest, "cpu_description", lambda: dict(NO_BF16_CPU))
    tiny = ["drafter=model", f"model.target={tiny_target}", f"model.draft_model={tiny_target}"]
    done = app(*SMOKE, *tiny, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    assert f"mars_bench: warning: {manifest.emulated_bf16_warning('bfloat16', None, NO_BF16_CPU)}" in done.stderr.splitlines()
    assert read_rows(tmp_path / "run" / "records.jsonl")
