"""The lm-eval model: the draft length is set as in the app (fixed, schedule, confidence), checked
before any model loads, and speculative decoding under it stays the target's greedy decode.
(The README's lm-eval command runs in test_readme.py.)"""

from __future__ import annotations

import pytest

from mars_bench.lm_eval_model import MarsBenchLM

SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"
GREEDY = {"max_gen_toks": 24, "until": []}


@pytest.mark.parametrize(("setting", "message"), [
    ({"length": "adaptive"}, "drafter.length='adaptive' is invalid: allowed are fixed, schedule, confidence"),
    ({"length": "schedule", "max_gamma": 3}, "drafter.max_gamma=3 is invalid: allowed is an integer >= gamma (5)"),
    ({"length": "confidence", "min_confidence": 1.5}, "drafter.min_confidence=1.5 is invalid: allowed is a number in (0, 1)"),
])  # fmt: skip
def test_a_bad_draft_length_is_refused_in_one_line_before_any_model_loads(setting, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        MarsBenchLM(target="no/such-model", drafter="layerskip", verifier="exact", **setting)


def test_a_tree_drafts_no_deeper_than_its_node_budget_under_a_schedule():
    with pytest.raises(ValueError, match=r"drafter.max_gamma=7 is invalid: allowed is an integer >= gamma \(8\)"):
        MarsBenchLM(target="no/such-model", drafter="model_tree", verifier="exact", gamma=8, length="schedule", tree_tokens=8)


@pytest.mark.slow
def test_each_draft_length_keeps_the_targets_greedy_decode():
    plain = MarsBenchLM(target=SMOLLM, drafter="none", verifier="exact", dtype="float32")
    context = plain.apply_chat_template([{"role": "user", "content": "Count from one to twenty in words."}])
    expected = plain.generate(context, GREEDY)
    for length, min_confidence in (("confidence", 0.4), ("schedule", None), ("fixed", None)):
        lm = MarsBenchLM(target=SMOLLM, drafter="layerskip", verifier="exact", dtype="float32", layers=24, length=length)
        assert lm.drafter.min_confidence == min_confidence and lm.draft_length == (length, 5, 16)
        assert lm.generate(context, GREEDY) == expected, length
