"""Every shipped task loads its prompt file from ../shared/data, and a bad question file is
reported with its file and line."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED_DATA, needs_shared_data
from hydra import compose, initialize_config_dir

from mars_bench.__main__ import CONF_DIR
from mars_bench.tasks import QuestionFileError, read_questions
from mars_bench.tasks.providers import load_questions

EXPECTED = {  # task -> (questions, turns per question) in the MARS prompt files (the official repository's data/)
    "mt_bench": (80, 2),
    "humaneval": (164, 1),
    "gsm8k": (121, 1),
    "alpaca": (80, 1),
    "cnndm": (80, 1),
    "qa": (80, 1),
    "wmt19": (100, 1),
    "aime2025": (30, 1),
}


@needs_shared_data
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
    with pytest.raises(QuestionFileError) as info:
        load_questions(cfg.task, str(tmp_path))
    message = str(info.value)
    assert message.startswith("task 'wmt19': no source has its questions; tried file ")
    assert "nowhere/q.jsonl (not found); hub wmt/wmt19/zh-en split validation (" in message
    assert message.endswith("; package (none pinned for this task)")


def fake_hub(monkeypatch, rows):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: rows)


@pytest.mark.parametrize(
    ("task", "row", "turn_start", "reference"),
    [
        ("gsm8k", {"question": "2+2?", "answer": "2+2=4\n#### 4"}, "Solve the following math problem", "#### 4"),
        (
            "humaneval",
            {"task_id": "HumanEval/7", "prompt": "def f():\n", "canonical_solution": "    return 1"},
            "Complete the code",
            "    return 1",
        ),
        ("wmt19", {"translation": {"zh": "你好", "en": "Hello"}}, "Translate the following Chinese", "Hello"),
        ("cnndm", {"id": "x1", "article": "Long text.", "highlights": "Short."}, "Summarize: Long text.", "Short."),
        ("aime2025", {"problem": "Find x.", "answer": 70}, "Solve the following math problem", "70"),
        ("alpaca", {"instruction": "Say hi", "input": "", "output": "hi"}, "Say hi", "hi"),
    ],
)
def test_hub_rows_become_questions_in_the_mars_prompt_format(monkeypatch, task, row, turn_start, reference):
    fake_hub(monkeypatch, [json.loads(json.dumps(row).replace("\\\\n", "\\n"))])
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"task={task}", "task.sources=[hub]"])
    (question,) = load_questions(cfg.task)
    assert question.turns[0].startswith(turn_start)
    assert question.reference[-1] == reference


@pytest.mark.parametrize(("task", "count", "turns"), [("gsm8k", 1319, 1), ("mt_bench", 80, 2), ("humaneval", 164, 1)])
@pytest.mark.slow
def test_pinned_packages_serve_questions_checked_by_hash(task, count, turns):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"task={task}", "task.sources=[package]", "task.num_prompts=null"])
    questions = load_questions(cfg.task)
    assert len(questions) == count and {len(q.turns) for q in questions} == {turns}


@pytest.mark.slow
def test_a_package_whose_data_does_not_match_its_hash_is_refused(monkeypatch):
    from dataclasses import replace

    from mars_bench.tasks import providers

    monkeypatch.setitem(providers.PACKAGES, "gsm8k", replace(providers.PACKAGES["gsm8k"], sha256="0" * 64))
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["task=gsm8k", "task.sources=[package]"])
    with pytest.raises(QuestionFileError, match="pinned 0000.*; refused"):
        load_questions(cfg.task)


@needs_shared_data
@pytest.mark.parametrize(("task", "file"), [("gsm8k", "gsm8k/question_full.jsonl"), ("humaneval", None), ("mt_bench", None)])
@pytest.mark.slow
def test_a_package_serves_the_same_prompts_as_the_mars_file(task, file):
    overrides = [f"task={task}", "task.num_prompts=null"] + ([f"task.file={file}"] if file else [])
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        from_file = compose(config_name="config", overrides=[*overrides, "task.sources=[file]"])
        from_package = compose(config_name="config", overrides=[*overrides, "task.sources=[package]"])
    a, b = load_questions(from_file.task, str(SHARED_DATA)), load_questions(from_package.task)
    assert [q.turns for q in a] == [q.turns for q in b]
    assert [q.question_id for q in a] == [q.question_id for q in b]
