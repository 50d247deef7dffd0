"""analysis/fidelity.py: the fidelity table's numbers equal sums computed by hand from synthetic
records (means per position, the gain over the strict rule on the same drafts, the distance to the
bound, gain per nat of KL, expected tau, the live row's score), the decomposition table gives the
live verifier's KL per generated token in the sweep's cell order, and records without fidelity
skip every fidelity artefact with the reason."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from mars_bench.analysis.__main__ import main
from mars_bench.analysis.cells import NotEnoughData
from mars_bench.analysis.fidelity import NO_FIDELITY, cell_order, decomposition_table, fidelity_table
from mars_bench.analysis.figures import frontier
from mars_bench.analysis.gather import gather

MARS = "mars(theta=0.9,guard=never,correction=residual)"
SETTINGS = {"rejection": (None, ""), "mars": (0.9, "theta=0.9,guard=never,correction=residual")}


def entry(positions, accept, kl, tv, draft_tv, expected_accepted=None, steps=3, judged=0, judged_kl=None, judged_tv=0.0):
    return {"positions": positions, "accept": accept, "kl": kl, "tv": tv, "draft_tv": draft_tv,
            "expected_accepted": expected_accepted, "steps": steps, "judged": judged, "judged_kl": judged_kl,
            "judged_tv": judged_tv}  # fmt: skip


def record(question, method, tokens, seconds, *, verifier="rejection", task="humaneval", temperature=1.0, cell="c", **extra):
    theta, setting = SETTINGS.get(verifier, (None, ""))
    return {
        "cell": cell, "model": "qwen", "drafter": "model", "task": task, "temperature": temperature, "verifier": verifier,
        "theta": theta, "verifier_setting": setting, "question_id": question, "turn": 1, "method": method, "status": "ok",
        "new_tokens": tokens, "prefill_s": 0.0, "decode_s": seconds, "steps": 3, "schema_version": 5, **extra,
    }  # fmt: skip


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


# Two records of a live rejection run, judged by the live rule and three shadows. tv_budget sits exactly
# on the bound 1 - TV(q, p) + TV(P_V, p); top_m's KL is infinite in one record (None), so NaN pooled.
FIDELITY = [
    {"rejection": entry(10, 6.0, 0.0, 1e-12, 4.0, 6.0, judged=8, judged_kl=0.0, judged_tv=1e-12),
     MARS: entry(10, 7.0, 0.2, 1.0, 4.0, 7.0), "tv_budget(eps=0.05)": entry(10, 6.5, 0.05, 0.5, 4.0, 6.5),
     "top_m(m=2)": entry(10, 8.0, None, 2.0, 4.0, 8.0)},
    {"rejection": entry(20, 10.0, 0.0, 0.0, 8.0, 10.0, judged=15, judged_kl=0.0, judged_tv=0.0),
     MARS: entry(20, 13.0, 0.4, 2.0, 8.0, 13.0), "tv_budget(eps=0.05)": entry(20, 13.0, 0.1, 1.0, 8.0, 13.0),
     "top_m(m=2)": entry(20, 15.0, 0.3, 4.0, 8.0, 15.0)},
]  # fmt: skip


def live_rejection_run(tmp_path):
    rows = []
    for question, (fidelity, score) in enumerate(zip(FIDELITY, (1.0, 0.0))):
        rows += [record(question, "baseline", 20, 2.0, score=score, fidelity=None),
                 record(question, "rejection", 20, 1.0, score=score, fidelity=fidelity, fidelity_s=0.1)]  # fmt: skip
    write_run(tmp_path / "run", rows)
    return gather([tmp_path])


def test_the_fidelity_table_pools_sums_per_rule_and_compares_with_the_strict_rule_on_the_same_drafts(tmp_path):
    table = fidelity_table(live_rejection_run(tmp_path)).set_index("rule")
    assert list(table.index) == ["rejection", MARS, "tv_budget(eps=0.05)", "top_m(m=2)"]  # live first, then as recorded
    assert table["role"].tolist() == ["live", "shadow", "shadow", "shadow"]
    assert table["family"].tolist() == ["rejection", "mars", "tv_budget", "top_m"]
    assert table.loc["tv_budget(eps=0.05)", "parameters"] == ""  # one setting per family: nothing varies
    assert (table["positions"] == 30).all() and (table["strict"] == "rejection").all()
    assert table["strict_acceptance"].tolist() == pytest.approx([16 / 30] * 4)
    mars = table.loc[MARS]
    assert mars["acceptance"] == pytest.approx(20 / 30)
    assert mars["gain"] == pytest.approx(4 / 30)
    assert mars["kl_per_position"] == pytest.approx(0.6 / 30)
    assert mars["tv_per_position"] == pytest.approx(3.0 / 30)
    assert mars["gain_per_kl"] == pytest.approx((4 / 30) / (0.6 / 30))
    assert mars["bound"] == pytest.approx(1 - 12 / 30 + 3 / 30) and mars["bound_gap"] == pytest.approx(0.7 - 20 / 30)
    assert mars["expected_tau"] == pytest.approx(1 + 20 / 6)
    budget = table.loc["tv_budget(eps=0.05)"]
    assert budget["bound"] == pytest.approx(0.65) and budget["bound_gap"] == pytest.approx(0.0, abs=1e-12)
    strict = table.loc["rejection"]
    assert strict["gain"] == 0 and np.isnan(strict["gain_per_kl"])  # lossless: no KL to divide by
    assert np.isnan(table.loc["top_m(m=2)", "kl_per_position"]) and np.isnan(table.loc["top_m(m=2)", "gain_per_kl"])
    assert strict["score"] == pytest.approx(0.5) and strict["score_ci_low"] <= 0.5 <= strict["score_ci_high"]
    assert table.loc[table["role"] == "shadow", ["score", "score_ci_low", "score_ci_high"]].isna().all().all()


def test_in_greedy_mode_the_strict_rule_is_exact_and_kl_is_missing(tmp_path):
    greedy = {"exact": entry(10, 4.0, None, 0.0, 6.0, 4.0), MARS: entry(10, 6.0, None, 2.0, 6.0, 6.0)}
    rows = [record(0, "baseline", 10, 2.0, temperature=0.0),
            record(0, "exact", 10, 1.0, verifier="exact", temperature=0.0, fidelity=greedy)]  # fmt: skip
    write_run(tmp_path / "run", rows)
    table = fidelity_table(gather([tmp_path])).set_index("rule")
    assert table.loc[MARS, "strict"] == "exact" and table.loc[MARS, "gain"] == pytest.approx(0.2)
    assert table["kl_per_position"].isna().all() and table["gain_per_kl"].isna().all()
    assert table.loc[MARS, "tv_per_position"] == pytest.approx(0.2)  # share of positions off the target's argmax
    assert frontier(table.reset_index(), tmp_path / "greedy.png").stat().st_size > 0  # no KL panel to draw: still made


def test_without_the_strict_rule_on_the_same_records_there_is_no_gain(tmp_path):
    first = {MARS: FIDELITY[0][MARS]}  # live mars: the strict rule judged in the second record only
    second = {MARS: FIDELITY[1][MARS], **FIDELITY[1]}
    write_run(tmp_path / "run", [record(q, "mars", 10, 1.0, verifier="mars", fidelity=f) for q, f in enumerate((first, second))])
    table = fidelity_table(gather([tmp_path])).set_index("rule")
    assert np.isnan(table.loc[MARS, "strict_acceptance"]) and np.isnan(table.loc[MARS, "gain"])  # one record lacks it
    assert table.loc["rejection", "strict_acceptance"] == pytest.approx(10 / 20)
    assert table.loc[MARS, "role"] == "live" and table.loc[MARS, "acceptance"] == pytest.approx(20 / 30)


def test_trees_have_no_bound_and_no_expected_tau(tmp_path):
    tree = {"rejection": entry(12, 6.0, 0.0, 0.0, None, None), MARS: entry(12, 9.0, 0.3, 1.2, None, None)}
    write_run(tmp_path / "run", [record(0, "baseline", 10, 2.0), record(0, "rejection", 10, 1.0, fidelity=tree)])
    table = fidelity_table(gather([tmp_path]))
    assert table[["draft_tv_per_position", "bound", "bound_gap", "expected_tau"]].isna().all().all()
    assert table["gain"].tolist() == pytest.approx([0.0, 0.25])
    assert frontier(table, tmp_path / "tree.png").stat().st_size > 0  # no bound, no tau panel: still made


@pytest.mark.parametrize("fidelity", ["absent", {}])  # records older than schema 5; a run with fidelity=false
def test_records_without_fidelity_skip_every_fidelity_artefact_with_the_reason(tmp_path, fidelity):
    extra = {} if fidelity == "absent" else {"fidelity": fidelity}
    write_run(tmp_path / "run", [record(0, "baseline", 10, 2.0, **extra), record(0, "rejection", 10, 1.0, **extra)])
    frame = gather([tmp_path / "run"])
    for build in (fidelity_table, decomposition_table):
        with pytest.raises(NotEnoughData, match=r"no method row carries fidelity \(run with fidelity=true\)"):
            build(frame)
    out = tmp_path / "out"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    index = (out / "index.md").read_text()
    assert f"- fidelity: skipped, {NO_FIDELITY}." in index
    assert not {"frontier.png", "fidelity.md", "decomposition.md"} & {p.name for p in out.iterdir()}


@pytest.mark.slow
def test_the_command_writes_the_fidelity_table_the_frontier_and_the_decomposition(tmp_path):
    live_rejection_run(tmp_path / "runs")
    out = tmp_path / "out"
    assert main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    made = {p.name for p in out.iterdir()}
    assert {"frontier.png", "fidelity.md", "fidelity.csv", "decomposition.md", "decomposition.csv"} <= made
    index = (out / "index.md").read_text()
    assert all(f"({name})" in index for name in ("frontier.png", "fidelity.md", "decomposition.csv"))
    assert "skipped, no method row carries fidelity" not in index
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stored = pd.read_parquet(out / "records.parquet")  # the nested mapping stored as JSON text
    assert json.loads(stored.loc[stored["method"] == "rejection", "fidelity"].iloc[0])["rejection"]["positions"] == 10


DECOMPOSITION = [  # the paper's gain, decomposed: (verifier, setting, judged KL per record, judged TV per record)
    ("rejection", "", 0.0, 0.0),
    ("mars_ref", "theta=off", 0.5, 1.0),
    ("mars", "theta=0.9,guard=never,correction=residual", 1.0, 2.0),
    ("mars_ref", "theta=0.9", 2.0, 3.0),
]


def decomposition_sweep(tmp_path):
    """Hydra's folders 0_..11_ (task-major): a plain sort would read 10_ and 11_ before 2_."""
    index = 0
    for task in ("humaneval", "gsm8k", "mt_bench"):
        for verifier, setting, kl, tv in DECOMPOSITION:
            live = entry(10, 5.0, kl, tv, 3.0, judged=8, judged_kl=kl, judged_tv=tv)
            cell = f"task={task},verifier={verifier},verifier.setting={setting}"
            keys = {"task": task, "cell": cell, "verifier": verifier, "verifier_setting": setting, "theta": None}
            rows = [record(0, "baseline", 40, 4.0, **keys),
                    record(0, verifier, 40, 1.0 + index, **keys, score=1.0,
                           fidelity={f"{verifier}({setting})" if setting else verifier: live})]  # fmt: skip
            write_run(tmp_path / f"{index}_{task}_{verifier}", rows)
            index += 1
    return gather([tmp_path])


def test_the_decomposition_follows_the_sweeps_cell_order_and_gives_kl_per_generated_token(tmp_path):
    table = decomposition_table(decomposition_sweep(tmp_path))
    settings = [(verifier, setting) for verifier, setting, _, _ in DECOMPOSITION]
    per_task = table[table["task"] != "all"]
    assert list(zip(per_task["task"], per_task["verifier"], per_task["verifier_setting"])) == [
        (task, *setting) for task in ("humaneval", "gsm8k", "mt_bench") for setting in settings
    ]
    assert per_task["cell"].iloc[0] == "task=humaneval,verifier=rejection,verifier.setting="
    pooled = table[table["task"] == "all"]
    assert list(zip(pooled["verifier"], pooled["verifier_setting"])) == settings and (pooled["prompts"] == 3).all()
    assert table.index[len(per_task) :].tolist() == pooled.index.tolist()  # the pooled rows come last
    kl = dict(zip(zip(per_task["task"], per_task["verifier_setting"]), per_task["kl_per_token"]))
    assert kl[("gsm8k", "theta=0.9")] == pytest.approx(2.0 / 40)
    assert pooled["kl_per_token"].tolist() == pytest.approx([0.0, 0.5 / 40, 1.0 / 40, 2.0 / 40])
    assert pooled["deviation_rate"].tolist() == pytest.approx([0.0, 1.0 / 40, 2.0 / 40, 3.0 / 40])
    first = per_task.iloc[0]  # cell 0: 40 tokens in 1 s against the baseline's 40 in 4 s
    assert first["speedup"] == pytest.approx(4.0) and first["tau"] == pytest.approx(39 / 3)
    assert first["score"] == 1.0 and first["expected_acceptance"] == pytest.approx(0.5)


def test_numeric_cells_order_as_numbers():
    rows = pd.DataFrame({"cell": ["10", "2", "0", "2"], "run_dir": ["a", "b", "c", "d"]})
    assert cell_order(rows).tolist() == [10, 2, 0, 2]
    named = pd.DataFrame({"cell": ["x", "y", "z"], "run_dir": ["S/10_x", "S/2_y", "S/1_z"]})
    assert cell_order(named).tolist() == [2, 1, 0]
