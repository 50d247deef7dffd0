"""The safety analysis: where a lossy rule's relaxed tokens fall in an answer (``records.relaxed_positions``, checked
against the target's own choices on a real decode), the first-L shares and the safety outcome with and without a
relaxed token there, and each rule's safety change against the lossless baseline, every cell computed by hand
from synthetic records; the option that sets L and the skip line without safety records."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from mars_bench import build_drafter, decode, get_verifier
from mars_bench.analysis.__main__ import main
from mars_bench.analysis.cells import method_summary
from mars_bench.analysis.gather import gather
from mars_bench.analysis.safety import answer_table, first_tokens_table, safety_pairs, safety_table
from mars_bench.bench.records import relaxed_positions
from mars_bench.bench.stats import bootstrap_mean_ci, paired_permutation_p, wilson_interval
from mars_bench.common.reasons import Reason
from mars_bench.verification import with_exact_first

E, R, S, X = Reason.EXACT, Reason.RELAXED, Reason.SAMPLED, Reason.REJECTED


@pytest.mark.parametrize(
    ("step_accepted", "reasons", "new_tokens", "expected"),
    [
        ([2, 1], [E, R, X, R], 6, [2, 4]),  # step 0 drafts at 1, 2 (bonus 3); step 1 at 4 (bonus 5)
        ([0, 3], [X, R, E, R], 4, [2]),  # step 1 drafts at 2, 3, 4: the budget cut position 4
        ([1, 0, 2], [R, X, X, S, E], 7, [1]),  # a step that kept nothing emits its correction at 3
        ([0, 2], [R, R], 4, [2, 3]),  # a step that drafted nothing (no codes) emits one token at 1
        ([], [], 5, []),  # the baseline: no steps
        ([2], [], 4, None),  # a trace without codes for its accepted drafts
    ],
)  # fmt: skip
def test_relaxed_positions_are_read_from_the_trace_by_hand(step_accepted, reasons, new_tokens, expected):
    row = {"step_accepted": step_accepted, "reasons": [int(code) for code in reasons], "new_tokens": new_tokens}
    assert relaxed_positions(row) == expected


def target_choices(target, prompt: list[int], tokens: list[int]) -> list[int]:
    """The target's argmax at each answer position given the prompt and the answer before it (one forward)."""
    logits = target(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


@pytest.mark.usefixtures("one_torch_thread")
def test_the_relaxed_positions_of_a_greedy_decode_are_where_the_answer_leaves_the_targets_choice():
    """Greedy MARS emits the target's argmax except where it relaxed a draft, so the positions the records give are
    exactly those where the answer differs from the target's own choice; inside an exact-first window of L, none
    lies below L. Budgets that cut a step's block short included."""
    target = tiny_model("llama", seed=0)
    noisy = tiny_model("llama", seed=0)
    torch.manual_seed(1)
    noisy.lm_head.weight.add_(0.1 * torch.randn_like(noisy.lm_head.weight))  # its argmax flips at near-ties
    drafter = build_drafter("model", model=noisy)
    prompt = [1, 5, 9, 2, 7]
    rule = get_verifier("mars", theta=0.5, guard="gap")
    found = 0
    for verifier, budget in ((rule, 60), (rule, 37), (with_exact_first(rule, 12), 60)):
        result = decode(target, drafter, verifier, prompt, max_new_tokens=budget, gamma=4)
        row = {"step_accepted": [step.accepted for step in result.steps], "new_tokens": result.new_tokens,
               "reasons": [code for step in result.steps for code in step.reasons]}  # as bench/rows.py records them  # fmt: skip
        positions = relaxed_positions(row)
        choices = target_choices(target, prompt, result.tokens)
        assert positions == [p for p, (token, choice) in enumerate(zip(result.tokens, choices)) if token != choice]
        assert len(positions) <= result.relaxed
        found += len(positions)
        if verifier is not rule:
            assert min(positions, default=12) >= 12
    assert found > 0


BASELINE_SCORES = [1, 1, 1, 1, 1]
MARS = [  # (step_accepted, reasons, new_tokens, score, finished, refusal_kept); relaxed positions in the comments
    ([2, 1], [E, R, X, R], 6, 0.0, True, False),  # 2, 4
    ([0, 3], [X, R, E, R], 4, 0.0, True, False),  # 2 (4 cut at the budget)
    ([1, 0, 2], [R, X, X, E, E], 7, 1.0, True, True),  # 1
    ([2], [E, E], 4, 1.0, True, True),  # none
    ([1], [R], 2, 0.0, False, False),  # 1, its answer cut at the budget: counted only with --include-cut
]  # fmt: skip


def row(question, method, score, *, new_tokens=5, finished=True, verifier="mars", step_accepted=(), reasons=(),
        refusal_kept=None, decode_s=1.0):  # fmt: skip
    safety = {"judge": "refusal", "verdicts": {"refusal": {"refused": bool(score), "kind": None}}}
    if method != "baseline":
        safety["refusal_kept"] = refusal_kept
    return {"cell": verifier, "model": "smol", "drafter": "layerskip", "task": "harmful", "scorer": "refusal_rate",
            "judge": "refusal", "temperature": 0.0, "verifier": verifier, "verifier_setting": "", "question_id": question,
            "turn": 0, "method": method, "status": "ok", "new_tokens": new_tokens, "prefill_s": 0.0, "decode_s": decode_s,
            "steps": len(step_accepted), "step_accepted": list(step_accepted), "reasons": [int(r) for r in reasons],
            "accepted": sum(step_accepted), "relaxed": sum(r == R for r in reasons), "drafted": sum(step_accepted) + 1,
            "score": score, "finished": finished, "stop_reason": "stop_token" if finished else "max_new_tokens",
            "safety": safety, "output_text": f"answer {question} of {method}", "output_ids": [question, 7]}  # fmt: skip


@pytest.fixture
def safety_records(tmp_path):
    """A mars cell and an exact cell of the harmful task, each with its own baseline rows (5 prompts, all refused)."""
    for verifier in ("mars", "exact"):
        rows = []
        for question, (accepted, reasons, tokens, score, done, kept) in enumerate(MARS):
            rows.append(row(question, "baseline", BASELINE_SCORES[question], new_tokens=tokens, verifier=verifier,
                            decode_s=2.0))  # fmt: skip
            if verifier == "mars":
                rows.append(row(question, "mars", score, new_tokens=tokens, finished=done, step_accepted=accepted,
                                reasons=reasons, refusal_kept=kept))  # fmt: skip
            else:  # lossless: the baseline's answer, every draft exact
                rows.append(row(question, "exact", 1, new_tokens=tokens, finished=done, verifier="exact",
                                step_accepted=[tokens - 1], reasons=[E] * (tokens - 1), refusal_kept=True))  # fmt: skip
        folder = tmp_path / "runs" / verifier
        folder.mkdir(parents=True)
        (folder / "records.jsonl").write_text("".join(json.dumps(line) + "\n" for line in rows))
    return gather([tmp_path / "runs"])


def test_the_first_tokens_table_counts_relaxed_tokens_and_outcomes_by_hand(safety_records):
    table = first_tokens_table(safety_pairs(safety_records), (1, 2, 4)).set_index(["verifier", "first_tokens"])
    mars = table.loc["mars"]
    assert list(mars["answers"]) == [4, 4, 4] and list(mars["untraced"]) == [0, 0, 0]  # the cut answer left out
    assert list(mars["tokens_first"]) == [4, 8, 16]
    assert list(mars["relaxed_first"]) == [0, 1, 3]  # L=2: position 1 of the third answer; L=4: positions 2, 2, 1
    assert list(mars["relaxed_share_first"]) == pytest.approx([0, 1 / 8, 3 / 16])
    assert list(mars["relaxed_share_all"]) == pytest.approx([4 / 21] * 3)  # 4 relaxed of 6 + 4 + 7 + 4 tokens
    assert list(mars["relaxed_answers"]) == [0, 1, 3] and list(mars["strict_answers"]) == [4, 3, 1]
    two, four = mars.loc[2], mars.loc[4]
    assert two["relaxed_rate"] == 1.0 and two["strict_rate"] == pytest.approx(1 / 3)  # refused: the third; 1 of 3
    assert (two["relaxed_rate_ci_low"], two["relaxed_rate_ci_high"]) == pytest.approx(wilson_interval(1, 1))
    assert (two["strict_rate_ci_low"], two["strict_rate_ci_high"]) == pytest.approx(wilson_interval(1, 3))
    assert two["rate_interval"] == "wilson"
    assert two["relaxed_change"] == 0.0 and two["strict_change"] == pytest.approx(-2 / 3)
    assert (two["strict_change_ci_low"], two["strict_change_ci_high"]) == pytest.approx(bootstrap_mean_ci([-1, -1, 0]))
    assert four["relaxed_rate"] == pytest.approx(1 / 3) and four["relaxed_change"] == pytest.approx(-2 / 3)
    assert four["strict_rate"] == 1.0 and four["strict_change"] == 0.0
    one = mars.loc[1]
    assert one["relaxed_answers"] == 0 and pd.isna(one["relaxed_rate"]) and one["strict_rate"] == 0.5
    exact = table.loc["exact"]
    assert (exact["relaxed_first"] == 0).all() and (exact["strict_change"] == 0).all()


def test_the_safety_table_pairs_each_rule_with_the_lossless_baseline_by_prompt(safety_records):
    pairs = safety_pairs(safety_records)
    table = safety_table(pairs).set_index("verifier")
    mars = table.loc["mars"]
    differences = [-1, -1, 0, 0]  # the four pairs where both answers finished
    assert mars["measure"] == "refusal_rate" and mars["judge"] == "refusal" and mars["prompts"] == 5
    assert mars["rate"] == 0.5 and mars["baseline_rate"] == 1.0 and mars["change"] == -0.5
    assert (mars["change_ci_low"], mars["change_ci_high"]) == pytest.approx(bootstrap_mean_ci(differences))
    assert mars["change_p"] == pytest.approx(paired_permutation_p(differences)) == 0.5
    assert mars["change_prompts"] == 4 and mars["change_cut"] == 1
    assert (mars["refusal_kept"], mars["baseline_refused"]) == (2, 4)
    settings = method_summary(safety_records).set_index("verifier")
    assert mars["speedup"] == pytest.approx(settings.loc["mars", "speedup"]) == pytest.approx(2.0)
    assert mars["tau"] == pytest.approx(settings.loc["mars", "tau"])
    assert table.loc["exact", "change"] == 0 and table.loc["exact", "refusal_kept"] == 4
    counted = safety_table(safety_pairs(safety_records, include_cut=True), include_cut=True).set_index("verifier")
    assert counted.loc["mars", "change"] == pytest.approx(-3 / 5) and counted.loc["mars", "change_prompts"] == 5


def test_the_answer_table_gives_each_answers_relaxed_positions_and_first_l_counts(safety_records):
    table = answer_table(safety_pairs(safety_records), (1, 2, 4))
    mars = table[table["verifier"] == "mars"].set_index("question_id")
    assert list(mars["relaxed_positions"]) == ["2 4", "2", "1", "", "1"]
    assert list(mars["first_relaxed"].astype(object).fillna(-1)) == [2, 2, 1, -1, 1]
    assert list(mars["relaxed_in_first_2"]) == [0, 0, 1, 0, 1] and list(mars["relaxed_in_first_4"]) == [1, 1, 1, 0, 1]
    assert list(mars["counted"]) == [True, True, True, True, False]
    assert list(mars["score_base"]) == BASELINE_SCORES


def test_the_analysis_writes_the_safety_artefacts_with_the_windows_asked_for(safety_records, tmp_path):
    out = tmp_path / "out"
    assert main([str(tmp_path / "runs"), "--out", str(out), "--first-tokens", "4,2"]) == 0
    first = pd.read_csv(out / "safety_first_tokens.csv")
    assert sorted(set(first["first_tokens"])) == [2, 4]
    assert {"relaxed_in_first_2", "relaxed_in_first_4"} <= set(pd.read_csv(out / "safety_answers.csv").columns)
    index = (out / "index.md").read_text()
    for name in ("safety.md", "safety_frontier.png", "safety_frontier_key.md", "safety_first_tokens.md", "safety_answers.csv"):
        assert f"({name})" in index and (out / name).is_file()
    shown = (out / "safety.md").read_text()
    mars = next(line for line in shown.splitlines() if "| mars | refusal_rate |" in line)
    assert "| 2.00x [2.00x, 2.00x] |" in mars and "| -0.500 [" in mars and mars.endswith("| 4 | 1 | 2/4 |")
    assert shown.rstrip().endswith("(--include-cut counts them).")  # the footnote on the pair a cut answer left out
    kept = pd.read_parquet(out / "records.parquet")  # the answers' hashes, never their text or token ids
    assert (kept["output_text"] == "").all() and kept["output_ids"].map(len).eq(0).all()
    texts = [f"answer {question} of {method}" for question, method in zip(kept["question_id"], kept["method"])]
    assert list(kept["output_sha256"]) == [hashlib.sha256(text.encode()).hexdigest() for text in texts]


def test_a_bad_first_tokens_value_is_refused_in_one_line(safety_records, tmp_path, capsys):
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--first-tokens", "0,4"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("analysis: error: --first-tokens '0,4' is invalid: allowed are whole numbers of tokens above 0, "
                     "separated by commas (default 1,2,4,8,16)")  # fmt: skip


def test_without_safety_records_the_index_says_why_the_safety_artefacts_were_skipped(tmp_path):
    rows = [{**row(0, method, 1.0, verifier="mars"), "task": "humaneval", "scorer": "humaneval", "judge": None, "safety": {}}
            for method in ("baseline", "mars")]  # fmt: skip
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "records.jsonl").write_text("".join(json.dumps(line) + "\n" for line in rows))
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    index = (tmp_path / "out" / "index.md").read_text()
    assert ("- safety tables and figure: skipped, no method row carries a safety judge's verdicts (run a safety task: "
            "task=harmful, jailbreak, injection or over_refusal).") in index  # fmt: skip
    assert not (tmp_path / "out" / "safety.md").exists()
