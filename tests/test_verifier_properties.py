"""Property-based tests over verifier inputs: for random logits (inf and NaN included), a
vocabulary of 1, empty drafts, all-equal logits and extreme temperatures, every verifier
returns a well-formed verdict or raises a one-line ValueError; it never crashes deeper
inside and never emits a token its own processing of the target's logits rules out."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import examples_on_every_core, property_examples
from hypothesis import given
from hypothesis import strategies as st

from mars_bench.verification import COUNT, VerifyInput, available_verifiers, get_verifier
from mars_bench.verification.sampling import SamplingParams, probabilities

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

LOGIT = st.one_of(
    st.floats(-50, 50, allow_nan=False, width=32),
    st.sampled_from([0.0, 1.0, -1.0, 1e-30, -1e-30, 1e30, -1e30, math.inf, -math.inf, math.nan]),
)
TEMPERATURE = st.sampled_from([0.0, 1e-30, 1e-6, 0.7, 1.0, 3.0, 1e6, 1e30])
FUZZ_CASES = property_examples(found=100, stress=300)  # per verifier; the counts are reported in docs/reliability.md


@st.composite
def steps(draw) -> VerifyInput:
    vocab = draw(st.integers(1, 6))
    drafted = draw(st.integers(0, 4))
    if draw(st.booleans()):
        rows = [[draw(LOGIT)] * vocab for _ in range(drafted + 1)]  # all-equal rows
    else:
        rows = [[draw(LOGIT) for _ in range(vocab)] for _ in range(drafted + 1)]
    high = vocab if draw(st.integers(0, 9)) else vocab + 2  # sometimes out of range
    drafts = [draw(st.integers(0, high - 1)) for _ in range(drafted)]
    sampling = SamplingParams(
        temperature=draw(TEMPERATURE), top_p=draw(st.sampled_from([1.0, 0.9, 0.3])), top_k=draw(st.sampled_from([0, 1, 2]))
    )
    dists = None
    if drafted and draw(st.booleans()):
        raw = torch.tensor([[draw(st.floats(0, 1, width=32)) for _ in range(vocab)] for _ in range(drafted)]) + 1e-3
        dists = raw / raw.sum(-1, keepdim=True)
    probs = torch.tensor([draw(st.floats(0, 1, width=32)) for _ in range(drafted)]) if draw(st.booleans()) else None
    return VerifyInput(
        draft_tokens=torch.tensor(drafts, dtype=torch.long),
        parents=torch.arange(-1, drafted - 1),
        target_logits=torch.tensor(rows, dtype=torch.float32),
        sampling=sampling,
        draft_probs=probs,
        draft_dists=dists,
    )


def well_formed(step: VerifyInput, verifier, verdict) -> None:
    n, vocab = step.num_drafts, step.target_logits.shape[-1]
    count = verdict.accepted_len
    assert 0 <= count <= n
    assert verdict.accepted.tolist() == list(range(count))
    assert 0 <= verdict.next_token < vocab
    processed = verifier.process(step.target_logits, step.sampling)
    assert math.isfinite(float(processed[count, verdict.next_token]))  # never a filtered token
    decisions = verdict.decisions
    assert len(decisions.reasons) == min(count + 1, n) and decisions.reasons.dtype == torch.long
    assert list(decisions.statistics) == [statistic.name for statistic in verifier.statistics]  # what it declares
    for statistic in verifier.statistics:
        found = decisions.statistics[statistic.name]
        assert found.dtype == (torch.bool if statistic.kind == COUNT else torch.float32) and len(found) == len(decisions.reasons)


@pytest.mark.slow  # FUZZ_CASES' inputs per verifier, half on each core
@pytest.mark.parametrize("name", available_verifiers())
def test_a_verdict_or_a_clear_error_never_a_crash(name):
    verifier = get_verifier(name)

    @given(step=steps(), seed=st.integers(0, 2**31 - 1))
    def check(step, seed):
        try:
            verdict = verifier.verify(step, generator=torch.Generator().manual_seed(seed))
        except ValueError as error:
            message = str(error)
            assert message.startswith("invalid verifier input: ") and "\n" not in message
            return
        well_formed(step, verifier, verdict)

    examples_on_every_core(check, FUZZ_CASES)


def test_bad_inputs_are_named():
    nan_step = VerifyInput(torch.tensor([0]), torch.tensor([-1]), torch.tensor([[math.nan, 1.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="invalid verifier input: target_logits contain NaN"):
        get_verifier("mars").verify(nan_step)
    outside = VerifyInput(torch.tensor([7]), torch.tensor([-1]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="a draft token is outside the vocabulary"):
        get_verifier("rejection").verify(outside)
    dead_row = VerifyInput(torch.tensor([0]), torch.tensor([-1]), torch.tensor([[-math.inf, -math.inf], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="a target_logits row has no finite entry"):
        get_verifier("exact").verify(dead_row)


def test_extreme_temperatures_keep_probabilities_finite():
    logits = torch.tensor([[30.0, 29.0, -5.0], [1.0, 2.0, 3.0]])
    step = VerifyInput(torch.tensor([1]), torch.tensor([-1]), logits, SamplingParams(temperature=1e-30))
    for name in available_verifiers():
        verdict = get_verifier(name).verify(step, generator=torch.Generator().manual_seed(0))
        assert verdict.next_token in (0, 2)  # near-zero temperature: the argmax of its row
    # Near-infinite temperature: p is uniform, so a one-hot draft of token 2 (logit -5) is kept a third of the time.
    hot = SamplingParams(temperature=1e30)
    assert torch.allclose(probabilities(logits, hot), torch.full((2, 3), 1 / 3))
    step = VerifyInput(torch.tensor([2]), torch.tensor([-1]), logits, hot)
    rejection = get_verifier("rejection")
    kept = sum(rejection.verify(step, generator=torch.Generator().manual_seed(seed)).accepted_len for seed in range(600))
    assert 150 < kept < 250
