"""docs/extending.md's examples, run as shown (in a process of their own, so that their registrations stay
out of the suite's registries): the verifier and the drafter decode with the engine (the drafter one prompt at
a time and four at once, alike), the verifier at its strictest setting gives what ``exact`` gives, and the backend
is one the app can choose."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"

CHECKS = '''
import torch
from conftest import tiny_model
from mars_bench import build_drafter, decode, get_verifier
from mars_bench.backends import available_backends, check_backend
from mars_bench.decoding.batched import decode_batch

torch.manual_seed(0)
model = tiny_model()
prompt = [5, 9, 9, 9, 3, 7]
exact = decode(model, build_drafter("repeat", copies=3), "exact", prompt, max_new_tokens=20, temperature=0.0)
strictest = decode(model, build_drafter("repeat", copies=3), get_verifier("floor", floor=1.0), prompt,
                   max_new_tokens=20, temperature=0.0)
assert strictest.tokens == exact.tokens and exact.drafted > 0, (strictest.tokens, exact.tokens)
relaxed = decode(model, build_drafter("repeat", copies=3), get_verifier("floor", floor=0.05), prompt,
                 max_new_tokens=20, temperature=1.0, seed=1)
assert len(relaxed.tokens) == 20 and relaxed.accepted >= 0
# its statistic, by the name it declares, at every judged depth of both modes
for result in (strictest, relaxed):
    assert set(result.rule_counts()) == {"over_floor"} and result.rule_values() == {}
    assert all(len(step.flags["over_floor"]) == len(step.reasons) for step in result.steps)
loose = decode(model, build_drafter("repeat", copies=3), get_verifier("floor", floor=1e-9), prompt,
               max_new_tokens=20, temperature=1.0, seed=1)
assert loose.rule_counts()["over_floor"] == sum(len(step.reasons) for step in loose.steps) > 0  # every draft over it
assert strictest.rule_counts()["over_floor"] == 0
prompts = [prompt, [7, 7, 1, 2, 7, 7], [3, 3, 3], [9]]
alone = [decode(model, build_drafter("repeat", copies=3), "exact", each, max_new_tokens=12, temperature=0.0) for each in prompts]
together = decode_batch(model, build_drafter("repeat", copies=3), "exact", prompts, max_new_tokens=12, temperature=0.0)
assert [r.tokens for r in together] == [r.tokens for r in alone] and sum(r.drafted for r in together) > 0
assert [[s.accepted for s in r.steps] for r in together] == [[s.accepted for s in r.steps] for r in alone]
try:
    get_verifier("floor", floor=0.0)
except ValueError as error:
    assert str(error) == "floor=0.0 is invalid: allowed is a number in (0, 1]", error
else:
    raise AssertionError("floor=0.0 was taken")
check_backend("logging")
assert "logging" in available_backends() and "transformers" in available_backends()
print("ok")
'''


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.mark.slow  # over a second
def test_the_extending_pages_examples_run():
    blocks = python_blocks()
    assert len(blocks) == 3  # a verifier, a drafter, a backend (a task is data: its YAML is checked below)
    script = "\n\n".join([*blocks, CHECKS])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_task_example_names_only_task_keys():
    from dataclasses import fields

    import yaml

    from mars_bench.config.schema import TaskConfig

    (block,) = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), flags=re.S)
    keys = set(yaml.safe_load(block))
    assert keys <= {item.name for item in fields(TaskConfig)} and {"name", "file", "scorer"} <= keys
