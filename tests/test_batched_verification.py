"""Batched verification: ``verify_batch`` on a step of B requests (``batch_steps``) gives each request the
verdict ``verify`` gives it alone, with the same random draws, and ``emission_batch`` each request's own
``emission``: for every registered verifier, over random ragged batches (chains and trees of different
sizes, requests with no drafts, greedy and sampling, with and without the drafter's distributions)."""

from __future__ import annotations

import pytest
import torch
from conftest import examples_on_every_core
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mars_bench.verification import VerifyInput, available_verifiers, batch_steps, get_verifier
from mars_bench.verification.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

LOGIT = st.one_of(st.floats(-10, 10, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, -1.0, 2.0]))
CHAINS = [(), (-1,), (-1, 0), (-1, 0, 1), (-1, 0, 1, 2)]
TREES = [(-1, -1), (-1, -1, 0), (-1, 0, 0), (-1, -1, 0, 1, 1)]
# Settings under which each rule's relaxation fires on logits like these (ties and close runner-ups).
SETTINGS = {
    "mars": {"theta": 0.5},
    "mars_ref": {"theta": 0.5},
    "typical": {"epsilon": 0.3, "delta": 0.9},
    "lenient": {"lenience": 0.5},
    "cascade": {"rule": "opt", "alpha": 0.5},
    "mentored": {"kl_budget": 0.05},
    "tv_budget": {"eps": 0.1},
    "threshold": {"threshold_single": 0.3, "threshold_acc": 0.5},
    "fsd": {"threshold": 0.4},
}
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # per verifier, on both cores


@st.composite
def request_step(draw, vocab: int, sampling: SamplingParams, chains_only: bool, with_dists: bool, with_probs: bool):
    """One request's step: a chain or a tree of distinct-sibling drafts (a chain only with ``with_dists``)."""
    parents = list(draw(st.sampled_from(CHAINS if chains_only or with_dists else CHAINS + TREES)))
    count = len(parents)
    logits = torch.tensor([[draw(LOGIT) for _ in range(vocab)] for _ in range(count + 1)], dtype=torch.float32).reshape(
        count + 1, vocab
    )
    tokens = [0] * count
    for row in range(count + 1):
        children = [node for node, parent in enumerate(parents) if parent + 1 == row]
        for node, token in zip(children, draw(st.permutations(range(vocab)))):
            tokens[node] = token
    dists = probs = None
    if with_dists:
        raw = (
            torch.tensor([[draw(st.floats(0, 1, width=32)) for _ in range(vocab)] for _ in range(count)]).reshape(count, vocab)
            + 1e-3
        )
        dists = raw / raw.sum(-1, keepdim=True)
        tokens = [draw(st.integers(0, vocab - 1)) for _ in range(count)]
        probs = dists[torch.arange(count), torch.tensor(tokens, dtype=torch.long)]
    elif with_probs:
        probs = torch.tensor([draw(st.floats(0.01, 1)) for _ in range(count)])
    return VerifyInput(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), logits, sampling,
                       draft_probs=probs, draft_dists=dists)  # fmt: skip


@st.composite
def ragged_batches(draw, chains_only: bool) -> list[VerifyInput]:
    """1 to 5 requests sharing a vocabulary and sampling settings, each with a step of its own shape."""
    vocab = draw(st.integers(3, 6))
    sampling = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
        top_k=draw(st.sampled_from([0, 2])),
        top_p=draw(st.sampled_from([1.0, 0.8])),
    )
    with_dists = draw(st.booleans())
    with_probs = draw(st.booleans())
    request = request_step(vocab, sampling, chains_only, with_dists, with_probs)
    return draw(st.lists(request, min_size=1, max_size=5))


def assert_same_verdict(batched, alone, request: int) -> None:
    where = f"request {request}"
    assert batched.accepted.tolist() == alone.accepted.tolist(), where
    assert batched.next_token == alone.next_token, where
    torch.testing.assert_close(batched.decisions.reasons, alone.decisions.reasons, rtol=0, atol=0, msg=f"{where}: reasons")
    assert batched.decisions.statistics.keys() == alone.decisions.statistics.keys(), where
    for name, second in alone.decisions.statistics.items():
        first = batched.decisions.statistics[name]
        torch.testing.assert_close(first, second, rtol=0, atol=0, equal_nan=True, msg=f"{where}: {name}")


def chains_only(verifier) -> bool:
    return verifier.chains_only


@pytest.mark.slow  # EXAMPLES random batches per verifier, half on each core
@pytest.mark.parametrize("name", available_verifiers())
def test_a_batch_gives_every_request_its_own_verdict_and_emission(name):
    verifier = get_verifier(name, **SETTINGS.get(name, {}))

    @given(steps=ragged_batches(chains_only(verifier)), seed=st.integers(0, 2**31 - 1))
    def check(steps, seed):
        batch = batch_steps(steps)
        streams = [torch.Generator().manual_seed(seed + request) for request in range(len(steps))]
        verdicts = verifier.verify_batch(batch, generator=streams)
        assert len(verdicts) == len(steps)
        for request, (step, verdict) in enumerate(zip(steps, verdicts)):
            assert_same_verdict(verdict, verifier.verify(step, generator=torch.Generator().manual_seed(seed + request)), request)
            assert verdict.path_tokens == step.draft_tokens[verdict.accepted].tolist(), f"request {request}: path tokens"
        for request, (step, emission) in enumerate(zip(steps, verifier.emission_batch(batch))):
            alone = verifier.emission(step)
            assert emission.rows.tolist() == alone.rows.tolist(), f"request {request}"
            torch.testing.assert_close(emission.dist, alone.dist, rtol=0, atol=1e-6, msg=f"request {request}: dist")
            torch.testing.assert_close(emission.accept, alone.accept, rtol=0, atol=1e-6, msg=f"request {request}: accept")

    examples_on_every_core(check, EXAMPLES)


def test_one_generator_for_a_batch_draws_in_order_and_a_wrong_count_is_refused():
    steps = [
        VerifyInput(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
                    SamplingParams(temperature=1.0)),
        VerifyInput(torch.tensor([3]), torch.tensor([-1]), torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),
                    SamplingParams(temperature=1.0)),
    ]  # fmt: skip
    batch = batch_steps(steps)
    rejection = get_verifier("rejection")
    shared = [verdict.next_token for verdict in rejection.verify_batch(batch, generator=torch.Generator().manual_seed(5))]
    again = [verdict.next_token for verdict in rejection.verify_batch(batch, generator=torch.Generator().manual_seed(5))]
    assert shared == again  # one generator: the batch draws from it in order, reproducibly
    with pytest.raises(ValueError, match="got 3 generators for a batch of 2 requests"):
        rejection.verify_batch(batch, generator=[torch.Generator() for _ in range(3)])
    with pytest.raises(ValueError, match="verify judges one request's step, got 2"):
        rejection.verify(batch)
    with pytest.raises(ValueError, match="emission states one request's step, got 2"):
        rejection.emission(batch)


def test_batch_steps_refuses_steps_that_cannot_share_a_batch():
    greedy = VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.zeros(2, 3))
    sampled = VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.zeros(2, 3), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="share their sampling"):
        batch_steps([greedy, sampled])
    with pytest.raises(ValueError, match="give draft_probs all or none"):
        batch_steps(
            [greedy, VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.zeros(2, 3), draft_probs=torch.tensor([0.5]))]
        )
    with pytest.raises(ValueError, match="needs at least one step"):
        batch_steps([])
    with pytest.raises(ValueError, match="drafts_per_row=\\(2,\\) is invalid"):
        get_verifier("exact").verify_batch(
            VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.zeros(3, 3), drafts_per_row=(2,))
        )


def test_a_bad_request_in_a_batch_is_named_as_it_is_alone():
    good = VerifyInput(torch.tensor([1]), torch.tensor([-1]), torch.zeros(2, 3))
    outside = VerifyInput(torch.tensor([7]), torch.tensor([-1]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="invalid verifier input: a draft token is outside the vocabulary"):
        get_verifier("mars").verify_batch(batch_steps([good, outside]))
    twins = VerifyInput(torch.tensor([1, 1]), torch.tensor([-1, -1]), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="two siblings carry the same token"):
        get_verifier("exact").verify_batch(batch_steps([good, twins]))
    # The same token in two requests' trees is no repeat: each request's root is its own.
    cousins = batch_steps([VerifyInput(torch.tensor([1, 2]), torch.tensor([-1, -1]), torch.zeros(3, 3))] * 2)
    assert [verdict.next_token for verdict in get_verifier("exact").verify_batch(cousins)] == [0, 0]
