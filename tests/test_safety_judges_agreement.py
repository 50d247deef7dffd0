"""benchmarks/safety_judges_agreement.py: the agreement figures by hand, an unclear hand label left out of every
comparison, and an answer that is not the one labelled refused in one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import load_script

from mars_bench.tasks.questions import Question

SCRIPT = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "safety_judges_agreement.py")


def test_cohens_kappa_by_hand():
    # 10 pairs: 4 both refused, 4 both not, 2 apart -> observed 0.8; each rater 0.5 refused -> chance 0.5; kappa 0.6
    pairs = [(True, True)] * 4 + [(False, False)] * 4 + [(True, False), (False, True)]
    assert SCRIPT.kappa(pairs) == 0.6
    assert SCRIPT.kappa([(True, True)] * 3) is None  # chance agreement is total: kappa is undefined


def test_agreement_leaves_out_unclear_labels_and_gives_a_judges_precision_and_recall():
    rows = [{"hand": True, "refusal": True}, {"hand": True, "refusal": False}, {"hand": False, "refusal": False},
            {"hand": None, "refusal": True}]  # fmt: skip
    found = SCRIPT.agreement(rows, "hand", "refusal")
    assert found["answers"] == 3 and found["agreement"]["hits"] == 2
    assert (found["precision"]["hits"], found["precision"]["of"]) == (1, 1)
    assert (found["recall"]["hits"], found["recall"]["of"]) == (1, 2)
    assert "precision" not in SCRIPT.agreement(rows, "refusal", "hand")  # only a judge against the hand labels


def test_a_labelled_answer_is_judged_and_hashed_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    answer = "I'm sorry, but I can't assist with that."
    label = {"run": "target", "question_id": "3", "answer_sha256": hashlib.sha256(answer.encode()).hexdigest(),
             "label": "declined", "refused": "1", "opening": answer}  # fmt: skip
    row = SCRIPT.verdict_row(label, {"output_text": answer}, Question(question_id=3, category="", turns=["q"]),
                             {"refusal": SCRIPT.refusal_judge})  # fmt: skip
    assert row["hand"] is True and row["refusal"] is True and row["answer_sha256"] == label["answer_sha256"]

    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"method": "exact", "question_id": 3, "output_text": answer + " Sure."}) + "\n")
    monkeypatch.setattr(SCRIPT, "OmegaConf", type("Conf", (), {"load": staticmethod(lambda path: type("C", (), {"task": None}))}))
    monkeypatch.setattr(SCRIPT, "load_questions", lambda task: [Question(question_id=3, category="", turns=["q"])])
    with pytest.raises(SystemExit, match="^run 'target' question 3: the answer differs from the one labelled"):
        SCRIPT.read_answers({"target": records}, [label])
