"""The plugin against each supported vLLM release's own acceptance function, without vLLM installed.

Fixtures (tests/fixtures/vllm, made by record.py there): small steps in the layout each release takes, with
what that release's own rule returned on them (its Triton kernels run in Triton's interpreter for the CUDA
builds). Here the plugin's judge gets the same inputs, called as the release's caller calls it."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mars_bench.serving.vllm_plugin import (
    PLACEHOLDER,
    FlatDraftsJudge,
    LogitRowsJudge,
    check_vllm,
    logit_rows_step,
)
from mars_bench.serving.vllm_versions import FLAT_DRAFTS, HOOKS, LOGIT_ROWS, SUPPORTED, hooks_of
from mars_bench.verification import get_verifier
from mars_bench.verification.exact_first import requests_of

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
FILES = sorted(FIXTURES.glob("*.pt"))
POSITIONAL = 12  # Model Runner V2's caller passes its first 12 arguments by position, the rest by name


def load(path: Path) -> dict:
    fixture = torch.load(path, weights_only=False)
    if fixture["layout"] == FLAT_DRAFTS:
        fixture["inputs"]["sampling_metadata"] = SimpleNamespace(**fixture["inputs"]["sampling_metadata"])
    return fixture


def judged(fixture: dict, verifier: str, **settings) -> object:
    """The plugin's judge for the fixture's layout, with ``verifier`` live, called as vLLM calls it."""
    inputs, names = fixture["inputs"], fixture["parameters"]
    if fixture["layout"] == FLAT_DRAFTS:
        judge = FlatDraftsJudge(get_verifier(verifier, **settings), builtin=None)
        return judge(*[inputs[name] for name in names if name in inputs])
    judge = LogitRowsJudge(get_verifier(verifier, **settings), builtin=None)
    judge.req_ids = [f"request-{b}" for b in range(len(inputs["idx_mapping"]))]  # as the runner's hook sets them
    return judge(*[inputs.get(name) for name in names[:POSITIONAL]], **{n: inputs[n] for n in names[POSITIONAL:] if n in inputs})


def by_request(fixture: dict, output: object) -> list[list[int]]:
    """Per request: the kept drafts then the next token, from either layout's output."""
    if fixture["layout"] == FLAT_DRAFTS:
        return [[token for token in row if token != PLACEHOLDER] for row in output.tolist()]
    sampled, num_sampled = output
    return [row[:count] for row, count in zip(sampled.tolist(), num_sampled.tolist())]


def test_every_supported_release_and_layout_has_its_fixtures():
    recorded = {(load(path)["vllm"], load(path)["layout"]) for path in FILES}
    expected = {(version, hook.layout) for version in SUPPORTED for hook in HOOKS[version]}
    assert recorded == expected
    assert ("0.34.0", FLAT_DRAFTS) not in recorded  # 0.34.0 has Model Runner V2 alone


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_the_plugin_was_written_against_each_releases_parameters(path):
    fixture = load(path)
    hook = next(hook for hook in hooks_of(fixture["vllm"]) if hook.layout == fixture["layout"])
    assert hook.module == fixture["module"]
    assert hook.parameters == fixture["parameters"]  # read from the release's own function when recorded


@pytest.mark.parametrize("path", [path for path in FILES if "greedy" in path.stem], ids=lambda path: path.stem)
def test_exact_through_the_plugin_returns_what_the_releases_own_greedy_rule_returns(path):
    fixture = load(path)
    ours = judged(fixture, "exact")
    assert by_request(fixture, ours) == by_request(fixture, fixture["output"])
    if fixture["layout"] == FLAT_DRAFTS:
        assert ours.dtype == fixture["output"].dtype and ours.shape == fixture["output"].shape
    else:
        assert ours[0].dtype == fixture["output"][0].dtype and ours[0].shape == fixture["output"][0].shape
        assert ours[1].dtype == fixture["output"][1].dtype
    kept = [len(tokens) - 1 for tokens in by_request(fixture, fixture["output"])]
    assert 0 < sum(kept) < sum(drafted(fixture))  # the release kept some drafts and rejected others


def drafted(fixture: dict) -> list[int]:
    """Per request of the fixture's step: its drafts (Model Runner V2: its logits rows less one, placeholders
    included)."""
    inputs = fixture["inputs"]
    if fixture["layout"] == FLAT_DRAFTS:
        return inputs["num_draft_tokens"]
    ends = inputs["cu_num_logits"].tolist()
    return [end - start - 1 for start, end in zip(ends[:-1], ends[1:])]


@pytest.mark.parametrize("path", [path for path in FILES if LOGIT_ROWS in path.stem], ids=lambda path: path.stem)
def test_a_placeholder_draft_is_rejected_as_the_release_rejects_it(path):
    fixture = load(path)
    inputs = fixture["inputs"]
    ends = inputs["cu_num_logits"].tolist()
    drafts = inputs["draft_sampled"].tolist()[ends[3] + 1 : ends[4]]
    assert PLACEHOLDER in drafts and drafts.index(PLACEHOLDER) == 2
    theirs, ours = by_request(fixture, fixture["output"])[3], by_request(fixture, judged(fixture, "rejection"))[3]
    assert len(theirs) <= 3 and len(ours) <= 3  # neither keeps a draft past the placeholder
    if "greedy" in path.stem:
        assert len(theirs) == 3 and ours == theirs  # its two drafts are the target's, then the target's token


def test_a_judge_without_the_batchs_request_ids_is_refused_in_one_line():
    fixture = load(FIXTURES / "0.34.0_logit_rows_greedy.pt")
    inputs, names = fixture["inputs"], fixture["parameters"]
    judge = LogitRowsJudge(get_verifier("exact"), builtin=None)
    judge.req_ids = ["request-0", "request-1"]  # fewer than the step's five requests
    with pytest.raises(RuntimeError, match=r"^vLLM judged 5 requests after 0, of a batch whose ids the plugin saw 2 of: "):
        judge(*[inputs.get(name) for name in names[:POSITIONAL]])


@pytest.mark.parametrize("path", [path for path in FILES if "sampled" in path.stem], ids=lambda path: path.stem)
def test_rejection_through_the_plugin_answers_in_the_releases_sampled_layout(path):
    """At T = 1 the release draws its own random numbers, so only the layout compares (the distribution is
    tests/test_vllm_backend.py's, where vLLM runs)."""
    fixture = load(path)
    ours, theirs = judged(fixture, "rejection"), fixture["output"]
    if fixture["layout"] == FLAT_DRAFTS:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        drafts, counts = fixture["inputs"]["draft_token_ids"].tolist(), fixture["inputs"]["num_draft_tokens"]
    else:
        assert [part.dtype for part in ours] == [part.dtype for part in theirs] and ours[0].shape == theirs[0].shape
        ends, inputs = fixture["inputs"]["cu_num_logits"].tolist(), fixture["inputs"]["draft_sampled"].tolist()
        drafts = [token for start, end in zip(ends[:-1], ends[1:]) for token in inputs[start + 1 : end]]
        counts = drafted(fixture)
    start = 0
    for tokens, count in zip(by_request(fixture, ours), counts):
        assert 1 <= len(tokens) <= count + 1 and tokens[:-1] == drafts[start : start + len(tokens) - 1]
        start += count


@pytest.mark.parametrize("greedy", [True, False])
def test_a_logit_rows_step_judged_at_once_is_each_request_judged_alone(greedy):
    fixture = load(FIXTURES / f"0.34.0_logit_rows_{'greedy' if greedy else 'sampled'}.pt")
    inputs = fixture["inputs"]
    step = logit_rows_step(inputs["target_logits"], inputs["draft_sampled"], inputs["cu_num_logits"], greedy)
    ends = inputs["cu_num_logits"].tolist()
    assert step.drafts_per_row == (3, 0, 2, 2, 2)  # request 3's drafts cut at its placeholder
    mars = get_verifier("mars", theta=0.5)
    together = mars.verify_batch(step, generator=[torch.Generator().manual_seed(b) for b in range(5)])
    for b, (own, verdict) in enumerate(zip(requests_of(step), together)):
        rows = inputs["target_logits"][ends[b] : ends[b] + own.num_drafts + 1]
        assert torch.equal(own.target_logits, rows.float())
        alone = mars.verify(own, generator=torch.Generator().manual_seed(b))
        assert torch.equal(verdict.accepted, alone.accepted) and verdict.next_token == alone.next_token


def test_a_release_outside_the_supported_ones_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^vLLM 0\.35\.0 is not supported: backend=vllm supports vLLM 0\.32\.0 to 0\.34\.0 "):
        hooks_of("0.35.0")
    with pytest.raises(ValueError, match=r"^vLLM 0\.31\.0 is not supported"):
        hooks_of("0.31.0")
    with pytest.raises(RuntimeError, match=r"^vLLM 0\.34\.0's .*rejection_sample takes target_logits, draft_logits, not the"):
        check_vllm("0.34.0", lambda target_logits, draft_logits: None, HOOKS["0.34.0"][0])
    assert [hook.layout for hook in hooks_of("0.32.0+cpu")] == [FLAT_DRAFTS, LOGIT_ROWS]


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_the_releases_own_function_passes_the_plugins_check(path):
    """The check ``register`` makes, on a function with the release's recorded parameters (as written there)."""
    fixture = load(path)
    hook = next(hook for hook in hooks_of(fixture["vllm"]) if hook.layout == fixture["layout"])

    def rejection_sample(*args, **kwargs):
        pass

    rejection_sample.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in fixture["parameters"]])
    check_vllm(fixture["vllm"], rejection_sample, hook)
    other = next(other for version in SUPPORTED for other in HOOKS[version] if other.parameters != hook.parameters)
    with pytest.raises(RuntimeError, match=r"^vLLM .* takes .*, not the .* backend=vllm was written against: supported are "):
        check_vllm(fixture["vllm"], rejection_sample, other)
