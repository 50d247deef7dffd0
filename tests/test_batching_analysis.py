"""analysis/batching.py: the cost model at batch B gives the seconds worked out by hand from the forward
costs; the batching table's measured and predicted speedups equal hand-computed values from synthetic
records; a disturbed batch leaves the speedups on both sides; the command writes the table, the model's
extrapolation and the figure where ``batch_costs.json`` lies beside the records."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from mars_bench.analysis.__main__ import main
from mars_bench.analysis.batching import (
    COSTS_FILE,
    ENGINE_STEPS,
    BatchCosts,
    batching_table,
    engine_step_costs,
    extrapolated,
    find_costs,
    modelled_finish_s,
    modelled_steps_s,
)
from mars_bench.analysis.cells import NotEnoughData
from mars_bench.analysis.gather import gather

SIZES, WIDTHS = (1, 2, 4), (1, 2, 3, 4, 5)


def linear_costs(target_per_token: float = 0.01, target_fixed: float = 0.1) -> dict:
    """Forward costs linear in B x width: target ``fixed + per_token * B * w``, drafter ``0.01 + 0.001 * B * w``."""
    return {
        "target_s": {str(b): {str(w): target_fixed + target_per_token * b * w for w in WIDTHS} for b in SIZES},
        "drafter_s": {str(b): {str(w): 0.01 + 0.001 * b * w for w in WIDTHS} for b in SIZES},
    }


def costs(**kwargs) -> BatchCosts:
    data = linear_costs(**kwargs)
    return BatchCosts(data["target_s"], data["drafter_s"])


def target(b, w):
    return 0.1 + 0.01 * b * w


def drafter(b, w):
    return 0.01 + 0.001 * b * w


def test_interpolation_is_exact_on_linear_costs_and_extends_past_the_deepest_width():
    model = costs()
    assert model.target_s(3, 2) == pytest.approx(target(3, 2))  # between timed batch sizes
    assert model.target_s(2, 7) == pytest.approx(target(2, 7))  # past the deepest width timed
    assert model.drafter_s(4, 4) == pytest.approx(drafter(4, 4))


def test_the_modelled_steps_of_a_batch_are_the_forwards_worked_out_by_hand():
    # row A drafts 3 (all accepted), then 2 (none); row B drafts 1 (rejected) and finishes
    rows = [([3, 2], [3, 0]), ([1], [0])]
    first = target(2, 4) + drafter(2, 2) + 2 * drafter(2, 1)  # deepest draft 3: a feed of 2 (the first step), 2 more
    second = target(1, 3) + drafter(1, 2) + 1 * drafter(1, 1)  # A alone, its feed 2 tokens (it accepted all 3)
    assert modelled_steps_s(rows, costs()) == pytest.approx(first + second)
    assert modelled_finish_s(rows, costs()) == pytest.approx([first + second, first])  # B's latency ends with its step
    assert modelled_steps_s([([0, 0, 0], [0, 0, 0])] * 2, costs()) == pytest.approx(3 * target(2, 1))  # AR: no drafter


def record(question, method, size, batch, seconds, tokens, drafted, accepted, *, verifier="rejection", disturbed=False):
    setting = "theta=0.9,guard=never,correction=residual" if verifier == "mars" else ""
    return {
        "cell": f"{verifier}_{size}", "model": "qwen", "drafter": "model", "task": "humaneval", "temperature": 1.0,
        "verifier": verifier, "verifier_setting": setting, "question_id": question, "turn": 1, "method": method,
        "status": "ok", "new_tokens": tokens, "prefill_s": 0.5, "decode_s": seconds - 0.5, "steps": len(drafted),
        "accepted": sum(accepted), "drafted": sum(drafted), "step_drafted": drafted, "step_accepted": accepted,
        "step_target_s": [0.2] * len(drafted), "step_draft_s": [0.01] * len(drafted), "batch_size": size,
        "batch_id": f"{batch}.1", "batch_rows": size, "batch_s": seconds, "finish_s": seconds, "disturbed": disturbed,
        "peak_memory_mb": 1000.0 + 10 * size, "schema_version": 9,
    }  # fmt: skip


def write_cell(folder, rows):
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def ar(question, size, batch, seconds, tokens, disturbed=False, verifier="rejection"):
    return record(question, "baseline", size, batch, seconds, tokens, [0] * (tokens - 1), [0] * (tokens - 1),
                  verifier=verifier, disturbed=disturbed)  # fmt: skip


@pytest.fixture
def sweep(tmp_path):
    """Two prompts of 5 tokens at B = 1 and 2, rejection and mars, each cell with its own baseline."""
    for verifier, speed in (("rejection", 1.0), ("mars", 0.8)):
        write_cell(tmp_path / "sweep" / f"{verifier}_1", [
            ar(0, 1, 0, 4.0, 5, verifier=verifier), ar(1, 1, 1, 4.0, 5, verifier=verifier),
            record(0, verifier, 1, 0, 2.0 * speed, 5, [2, 2], [2, 0], verifier=verifier),
            record(1, verifier, 1, 1, 2.0 * speed, 5, [2, 2], [1, 1], verifier=verifier)])  # fmt: skip
        write_cell(tmp_path / "sweep" / f"{verifier}_2", [
            ar(0, 2, 0, 5.0, 5, verifier=verifier), ar(1, 2, 0, 5.0, 5, verifier=verifier),
            record(0, verifier, 2, 0, 4.0 * speed, 5, [2, 2], [2, 0], verifier=verifier),
            record(1, verifier, 2, 0, 4.0 * speed, 5, [2, 2], [1, 1], verifier=verifier)])  # fmt: skip
    return tmp_path / "sweep"


def test_the_batching_table_gives_the_hand_computed_speedups_and_predictions(sweep):
    table = batching_table(gather([sweep]), costs())
    row = table[(table["rule"] == "rejection") & (table["batch_size"] == 2)].iloc[0]
    assert row["speedup"] == pytest.approx((10 / 4.0) / (10 / 5.0))  # one batch a side: tokens over its wall time
    ar_s = 0.5 + 4 * target(2, 1)  # the measured prefill, then 4 steps of two rows
    # step 1: both rows draft 2 (feed 2); step 2: row 0 accepted all, so its feed is 2 tokens
    spec_s = 0.5 + 2 * (target(2, 3) + drafter(2, 2) + drafter(2, 1))
    assert row["predicted_speedup"] == pytest.approx(ar_s / spec_s)
    assert row["measured_over_predicted"] == pytest.approx(row["speedup"] / row["predicted_speedup"])
    assert row["predicted_latency_speedup"] == pytest.approx(ar_s / spec_s)  # both rows of a side finish together
    assert row["target_in_run_over_model"] == pytest.approx((2 * 0.2) / (2 * target(2, 3)))  # a batch's step counted once
    assert row["tau"] == pytest.approx((4 + 4) / 4)  # 4 tokens after the prefill's, 2 steps, per row
    assert row["peak_memory_mb"] == 1020.0 and row["prompts"] == 2 and row["disturbed"] == 0
    mars = table[(table["rule"].str.startswith("mars")) & (table["batch_size"] == 2)].iloc[0]
    assert mars["gain_over_strict"] == pytest.approx(1 / 0.8)  # the strict rule at T = 1 is rejection
    assert mars["rule"] == "mars"  # one setting of the rule at every B: its bare name (the batch size is a column)
    without = batching_table(gather([sweep]), None)
    assert "predicted_speedup" not in without and without["speedup"].tolist() == table["speedup"].tolist()


def test_a_disturbed_batch_leaves_its_prompts_out_on_both_sides_unless_asked(tmp_path):
    rows = [ar(0, 2, 0, 5.0, 5, disturbed=True), ar(1, 2, 0, 5.0, 5, disturbed=True), ar(2, 2, 1, 6.0, 5), ar(3, 2, 1, 6.0, 5),
            *[record(q, "rejection", 2, q // 2, 3.0, 5, [2, 2], [1, 1]) for q in range(4)]]  # fmt: skip
    write_cell(tmp_path / "s" / "a", rows)
    write_cell(tmp_path / "s" / "b", [ar(0, 1, 0, 4.0, 5), record(0, "rejection", 1, 0, 2.0, 5, [2, 2], [1, 1])])
    table = batching_table(gather([tmp_path / "s"]), None).set_index("batch_size")
    assert table.loc[2, "disturbed"] == 2 and table.loc[2, "prompts"] == 2
    assert table.loc[2, "speedup"] == pytest.approx((10 / 3.0) / (10 / 6.0))  # the undisturbed batch only
    counted = batching_table(gather([tmp_path / "s"]), None, include_disturbed=True).set_index("batch_size")
    assert counted.loc[2, "speedup"] == pytest.approx((20 / 6.0) / (20 / 11.0)) and counted.loc[2, "prompts"] == 4


def test_the_model_extrapolates_to_every_timed_batch_size_and_finds_where_it_stops_paying(sweep):
    cheap = extrapolated(gather([sweep]), costs())  # fixed costs dominate: speculation pays at every B
    assert sorted(cheap["batch_size"].unique()) == [1, 2, 4] and cheap["crossover"].isna().all()
    steep = extrapolated(gather([sweep]), costs(target_per_token=1.0, target_fixed=0.0))  # compute-bound target
    rejection = steep[steep["rule"] == "rejection"].set_index("batch_size")
    assert (rejection["modelled_speedup"] < 1).all() and (rejection["crossover"] == 1).all()


def test_one_batch_size_is_not_enough(tmp_path):
    write_cell(tmp_path / "s" / "a", [ar(0, 1, 0, 4.0, 5), record(0, "rejection", 1, 0, 2.0, 5, [2, 2], [1, 1])])
    with pytest.raises(NotEnoughData, match="one batch size"):
        batching_table(gather([tmp_path / "s"]), None)


def test_the_command_writes_the_batching_table_model_and_figure_with_the_costs_beside_the_records(sweep, tmp_path):
    (sweep / "batch_costs.json").write_text(json.dumps(linear_costs()))
    assert find_costs([sweep]) is not None
    assert main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    index = (tmp_path / "out" / "index.md").read_text()
    for name in ("batching.md", "batching.csv", "batching_model.md", "batching.png"):
        assert f"[{name}]({name})" in index
    assert "predicted_speedup" in (tmp_path / "out" / "batching.md").read_text()


def served_by_vllm(row: dict, step_s: float | None) -> dict:
    """``row`` as backend=vllm writes it: with vLLM's engine steps after the prefill (each ``step_s`` seconds,
    serving the row's batch size) where ``step_s`` is given."""
    steps = len(row["step_drafted"]) if step_s is not None else 0
    return {**row, "backend": "vllm", "schema_version": 13, "step_target_s": [0.0] * len(row["step_drafted"]),
            "engine_step_s": [step_s] * steps, "engine_step_rows": [row["batch_size"]] * steps}  # fmt: skip


def vllm_sweep(folder, with_steps: bool = True):
    """The ``sweep`` fixture's rejection cells as vLLM served them: a step of B requests takes 0.1 + 0.1 B s
    autoregressive, 0.3 + 0.1 B s with 2 drafts."""
    for size in (1, 2):
        batch = 0 if size == 2 else None
        ids = {q: q if batch is None else batch for q in (0, 1)}
        rows = [served_by_vllm(ar(q, size, ids[q], 4.0 + size - 1, 5), 0.1 + 0.1 * size if with_steps else None)
                for q in (0, 1)]  # fmt: skip
        rows += [served_by_vllm(record(q, "rejection", size, ids[q], 2.0 * size, 5, [2, 2], [2 - q, q]),
                                0.3 + 0.1 * size if with_steps else None) for q in (0, 1)]  # fmt: skip
        write_cell(folder / f"rejection_{size}", rows)
    return folder


def test_vllms_rows_are_priced_by_its_own_step_times_and_never_by_this_engines_forward_costs(tmp_path):
    frame = gather([vllm_sweep(tmp_path / "vllm")])
    (priced,) = engine_step_costs(frame).values()
    assert priced.source == ENGINE_STEPS and priced.batch_sizes == [1, 2]
    assert priced.target_s(2, 1) == pytest.approx(0.3) and priced.target_s(1, 3) == pytest.approx(0.4)
    assert priced.drafter_s(2, 3) == 0.0  # vLLM drafts inside its step
    row = batching_table(frame, costs()).set_index("batch_size").loc[2]  # costs(): this engine's, not used for vLLM's rows
    ar_s, spec_s = 0.5 + 4 * 0.3, 0.5 + 2 * 0.5  # the measured prefill, then the steps of two rows
    assert row["predicted_speedup"] == pytest.approx(ar_s / spec_s) and row["costs"] == ENGINE_STEPS
    assert row["target_in_run_over_model"] != row["target_in_run_over_model"]  # NaN: vLLM's steps hold no forward of ours
    model = extrapolated(frame, costs()).set_index("batch_size")
    assert list(model.index) == [1, 2] and (model["costs"] == ENGINE_STEPS).all()
    unpriced = batching_table(gather([vllm_sweep(tmp_path / "old", with_steps=False)]), costs())
    assert "predicted_speedup" not in unpriced  # vLLM rows without their steps: this engine's costs would be wrong
    with pytest.raises(NotEnoughData, match="have costs"):
        extrapolated(gather([tmp_path / "old"]), costs())


def rewritten(source, folder, **fields):
    """``source``'s records files copied below ``folder``, every row with ``fields`` set (a newer writer's rows)."""
    for records in sorted(source.rglob("records.jsonl")):
        rows = [{**json.loads(line), **fields} for line in records.read_text().splitlines()]
        write_cell(folder / records.parent.relative_to(source), rows)
    return folder


def priced_tables(folder) -> tuple:
    frame = gather([folder])
    return batching_table(frame, costs()), extrapolated(frame, costs())


@pytest.mark.parametrize("with_steps", [True, False])
def test_records_of_schema_14_say_which_engine_decoded_them_and_older_ones_are_priced_as_before(sweep, tmp_path, with_steps):
    """Our engine's rows and vLLM's, written before ``own_engine`` (schemas 9 and 13) and with it (14), give the same
    tables: the field an older row lacks is what its backend's name implied."""
    old_vllm = vllm_sweep(tmp_path / "vllm", with_steps=with_steps)
    for old, engine in ((sweep, True), (old_vllm, False)):
        new = rewritten(old, tmp_path / f"new_{engine}", schema_version=14, own_engine=engine)
        assert set(gather([old])["own_engine"]) == set(gather([new])["own_engine"]) == {engine}
        if engine or with_steps:
            for before, after in zip(priced_tables(old), priced_tables(new)):
                pd.testing.assert_frame_equal(before, after)
        else:  # vLLM's rows without their steps: priced neither way
            assert "predicted_speedup" not in batching_table(gather([new]), costs())


def test_batch_costs_price_the_rows_whose_records_say_our_engine_decoded_them_whatever_the_backends_name(sweep, tmp_path):
    """A backend of its own name on this package's engine (a subclass of the transformers backend) is priced by
    batch_costs.json as ``transformers`` is; rows that say another engine decoded them are not, whatever the name."""
    ours, _ = priced_tables(sweep)
    logging = rewritten(sweep, tmp_path / "logging", schema_version=14, backend="logging", own_engine=True)
    table, _ = priced_tables(logging)
    assert table["predicted_speedup"].tolist() == pytest.approx(ours["predicted_speedup"].tolist())
    assert (table["costs"] == COSTS_FILE).all()
    other = rewritten(sweep, tmp_path / "other", schema_version=14, own_engine=False)  # named transformers
    assert "predicted_speedup" not in batching_table(gather([other]), costs())
    with pytest.raises(NotEnoughData, match="have costs"):
        extrapolated(gather([other]), costs())
