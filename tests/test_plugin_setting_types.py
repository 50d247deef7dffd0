"""A plugin's settings keep their own types: two verifiers may declare one setting name with different types
(``threshold: str`` and ``threshold: float``). The app still imports and composes each, and each refuses a value
its own type cannot take, in one line at start. (Before, every plugin's settings went into one schema of the
group, which refused the second type when the app imported.)"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from mars_bench.config.overrides import check_override_keys, check_override_values, declared_types
from mars_bench.config.schema import PLUGIN_GROUPS
from mars_bench.verification import base

REPO = Path(__file__).resolve().parents[1]

# Two verifiers whose settings share a name with different types; registered in the process that imports the app.
TWO_VERIFIERS = '''
from dataclasses import dataclass

from mars_bench.verification import register_verifier
from mars_bench.verification.strict import ExactVerifier


@dataclass(frozen=True)
class WordedParams:
    threshold: str = "high"


@dataclass(frozen=True)
class NumberedParams:
    threshold: float = 0.5


register_verifier("worded", params=WordedParams)(type("WordedVerifier", (ExactVerifier,), {}))
register_verifier("numbered", params=NumberedParams)(type("NumberedVerifier", (ExactVerifier,), {}))
'''

# Then the app, as ``python -m mars_bench`` starts: each command's exit status and stderr, and what the config
# of a taken command composes to; one JSON line per command.
RUN_THE_APP = '''
import contextlib, io, json, sys

import mars_bench.__main__ as app  # stores every plugin's schema (register_configs)
from hydra import compose, initialize_config_dir

search, refused, composed = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
for command in refused:
    sys.argv = ["mars_bench", *command, f"hydra.searchpath=[file://{search}]"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            app.start()
            status = 0
        except SystemExit as stop:
            status = stop.code
    print(json.dumps({"command": command, "status": status, "stderr": err.getvalue()}))
for command in composed:
    with initialize_config_dir(config_dir=app.CONF_DIR, version_base=None):
        try:
            cfg = compose(config_name="config", overrides=[*command, f"hydra.searchpath=[file://{search}]"])
            print(json.dumps({"command": command, "threshold": cfg.verifier.threshold}))
        except Exception as error:
            print(json.dumps({"command": command, "error": type(error).__name__}))
'''


@pytest.mark.slow  # a new interpreter that imports the app
def test_two_verifiers_may_give_one_setting_name_two_types(tmp_path):
    conf = tmp_path / "conf"
    (conf / "verifier").mkdir(parents=True)
    for name in ("worded", "numbered"):  # as conf/verifier/<name>.yaml extends a shipped verifier's schema
        (conf / "verifier" / f"{name}.yaml").write_text(f"defaults:\n  - /verifier_{name}_schema@_here_\n  - _self_\n")
    refused = [["verifier=numbered", "verifier.threshold=abc"], ["verifier=worded", "verifier.threshold=[a,b]"]]
    composed = [["verifier=numbered", "verifier.threshold=0.25"], ["verifier=worded", "verifier.threshold=abc"],
                ["verifier=worded"], ["verifier=numbered", "verifier.threshold=abc"]]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", TWO_VERIFIERS + RUN_THE_APP, str(conf), json.dumps(refused),
                           json.dumps(composed)], capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines[:2] == [
        {"command": refused[0], "status": 2,
         "stderr": "mars_bench: error: verifier.threshold=abc is invalid: allowed is a number\n"},
        {"command": refused[1], "status": 2,
         "stderr": "mars_bench: error: verifier.threshold=[a,b] is invalid: allowed is a string\n"},
    ]  # fmt: skip
    assert lines[2:] == [
        {"command": composed[0], "threshold": 0.25},
        {"command": composed[1], "threshold": "abc"},
        {"command": composed[2], "threshold": "high"},  # the plugin's own default
        {"command": composed[3], "error": "ConfigCompositionException"},  # Hydra's own check: numbered's float
    ]


@pytest.fixture
def two_verifiers(monkeypatch):
    """``TWO_VERIFIERS``, registered in a copy of the verifier registry that the test's end puts back."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    exec(TWO_VERIFIERS, {})


def test_each_verifier_checks_a_value_against_its_own_type(two_verifiers):
    verifiers = PLUGIN_GROUPS["verifier"]
    own = [(item.name, item.type) for item in fields(verifiers.schema("worded")) if item.name not in ("name", "exact_first")]
    assert own == [("threshold", str)]  # besides the keys every verifier takes (VerifierCommon)
    assert [(item.name, item.type) for item in fields(verifiers.schema("numbered"))][-1] == ("threshold", float)
    assert declared_types("verifier.threshold", ["verifier=worded"]) == [str]
    assert declared_types("verifier.threshold", ["-m", "verifier=worded,numbered"]) == [str, float]  # each a sweep runs
    check_override_keys(["verifier=worded", "verifier.threshold=abc"])
    check_override_values(["verifier=worded", "verifier.threshold=abc"])
    check_override_values(["verifier=numbered", "verifier.threshold=0.25"])
    with pytest.raises(ValueError, match=r"^verifier.threshold=abc is invalid: allowed is a number$"):
        check_override_values(["verifier=numbered", "verifier.threshold=abc"])
    with pytest.raises(ValueError, match=r"^verifier.threshold=abc is invalid: allowed is a number$"):
        check_override_values(["-m", "verifier=worded,numbered", "verifier.threshold=abc"])
    with pytest.raises(ValueError, match=r"^verifier.threshold=\[a,b\] is invalid: allowed is a string$"):
        check_override_values(["verifier=worded", "verifier.threshold=[a,b]"])
    with pytest.raises(ValueError, match=r"^verifier.threshold=abc is invalid: allowed is a number$"):
        check_override_values(["verifier=fsd", "verifier.threshold=abc"])  # docs/verifiers.md: a shipped one's, as ever
