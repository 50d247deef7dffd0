"""Every shipped task loads its prompt file from ../shared/data, and a bad question file is
reported with its file and line."""

from __future__ import annotations

import pytest
from conftest import SHARED_DATA
from hydra import compose, initialize_config_dir

from mars_bench.__main__ import CONF_DIR
from mars_bench.tasks import QuestionFileError, read_questions
from mars_bench.tasks.loading import load_questions

EXPECTED = {  # task -> (questions, turns per question), as listed in reference/mars.md section 6
    "mt_bench": (80, 2),
    "humaneval": (164, 1),
    "gsm8k": (121, 1),
    "alpaca": (80, 1),
    "cnndm": (80, 1),
    "qa": (80, 1),
    "wmt19": (100, 1),
    "aime2025": (30, 1),
}


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs ../shared/data")
@pytest.mark.parametrize("task", sorted(EXPECTED))
def test_every_task_loads_all_its_questions(task):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"task={task}", "task.num_prompts=null"])
    questions = load_questions(cfg.task, str(SHARED_DATA))
    count, turns = EXPECTED[task]
    assert len(questions) == count
    assert {len(q.turns) for q in questions} == {turns}


def test_a_missing_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["a"]}\n\n{"question_id": 2}\n')
    with pytest.raises(QuestionFileError, match=rf"{path}:3: missing field 'turns'"):
        read_questions(path)


def test_turns_must_be_a_list_of_strings(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": "just a string"}\n')
    with pytest.raises(QuestionFileError, match=rf"{path}:1: field 'turns' must be a non-empty list of strings"):
        read_questions(path)


def test_a_missing_file_lists_the_places_tried(tmp_path):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["task=wmt19", "task.file=nowhere/q.jsonl"])
    with pytest.raises(QuestionFileError, match="task 'wmt19': question file 'nowhere/q.jsonl' not found; tried"):
        load_questions(cfg.task, str(tmp_path))
