"""Jailbreaks: a task's requests, each wrapped in published attack templates (``task.attacks``).

The templates are PyRIT's (``pyrit/datasets/jailbreak/templates/<name>.yaml`` in its pinned wheel, each by
SHA-256). A template's text holds one ``{{ prompt }}`` slot; the request is put there by plain replacement (the
template is data, never rendered by a template engine). A wrapped question is ``<request id>/<attack>``; its
``request`` is the bare request, which the judges grade the answer against.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import yaml

from mars_bench.tasks.questions import Question, QuestionFileError
from mars_bench.tasks.safety.sets import PYRIT
from mars_bench.tasks.sources import QuestionSet, from_package_member

TEMPLATES = "pyrit/datasets/jailbreak/templates/"
SLOT = "{{ prompt }}"
# attack -> the SHA-256 of its template: the Wei et al. (2023) attacks and persona prompts of the in-the-wild
# collection that PyRIT keeps (docs/tasks.md#safety)
ATTACKS = {
    "prefix_injection": "3906c2fac67c8287ed0df2c39e95796c22d73eff89e850399defcbf44f0d37ed",
    "refusal_suppression": "2dbcb1b175c8fa98b74b9e659ccb702728512f1f1011b5875518b344f4474056",
    "style_injection": "1773a326ff50266656684da5afb8904d6fa46bcf5aeb58b7564eb2b34dca209a",
    "evil_confidant": "3bb914c804ac7c698475530ea662a0075dd65f37ca276349da49625345109b3e",
    "hypothetical_response": "1306c0700bdc3f49beb3bac152bc169c15f470cb34d7b420928c53a3a1ef8b61",
    "aim": "2b685c9509991182e0f93b42f1442244561c4ddce1e6cce759a18cce6446410f",
    "dev_mode_compact": "58050270481a9b04e5c1e62280f0e63e05324f645585d3a076471984dae0ccaf",
    "dan_11": "3a6aaee7c9fc9a40ff049ea9a4e43bf5ddd48de5fa83282214325d7f9bfc7810",
}


def check_attacks(attacks: Any) -> None:
    """Refuse, in one line, a ``task.attacks`` entry that is not a pinned template."""
    for attack in attacks or ():
        if attack not in ATTACKS:
            raise ValueError(f"task.attacks entry {attack!r} is unknown: allowed are {', '.join(ATTACKS)}")


def attack_template(attack: str) -> str:
    """The text of ``attack``'s template, with its one ``{{ prompt }}`` slot."""
    member = f"{TEMPLATES}{attack}.yaml"
    template = yaml.safe_load(from_package_member(PYRIT, member, ATTACKS[attack]).decode("utf-8"))
    text = template.get("value", "")
    if template.get("parameters") != ["prompt"] or text.count(SLOT) != 1:
        raise QuestionFileError(f"package {PYRIT}: {member} has not exactly one {SLOT} slot")
    return text


def wrap(question: Question, attack: str, template: str) -> Question:
    """``question``'s request inside ``template``: the question ``<id>/<attack>``, its bare request kept."""
    request = question.turns[0]
    return replace(question, question_id=f"{question.question_id}/{attack}", turns=[template.replace(SLOT, request)],
                   category=attack, request=request)  # fmt: skip


def wrap_in_attacks(served: QuestionSet, attacks: list[str]) -> QuestionSet:
    """Every served request under every attack, the requests in order, each under the attacks in order; the
    manifest's source says which templates wrapped them."""
    check_attacks(attacks)
    templates = {attack: attack_template(attack) for attack in attacks}
    questions = [wrap(question, attack, templates[attack]) for question in served.questions for attack in attacks]
    package, version = PYRIT.split("==")
    pinned = {"package": package, "version": version, "members": {a: f"{TEMPLATES}{a}.yaml" for a in attacks},
              "sha256": {a: ATTACKS[a] for a in attacks}}  # fmt: skip
    return QuestionSet(questions, {**served.source, "attacks": pinned})
