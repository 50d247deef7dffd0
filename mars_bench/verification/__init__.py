"""Verifiers: pure tensor functions registered by name (``base.register_verifier``; ``base.Verifier`` is the contract).

from mars_bench.verification import VerifyInput, get_verifier
verdict = get_verifier("mars", theta=0.9).verify(step, generator=generator)
verdicts = get_verifier("mars").verify_batch(batch_steps(steps), generator=generators)  # B requests at once
verdict.decisions.statistics  # per statistic the verifier declares (get_verifier("mars").statistics)
verifier_settings("mars")  # MarsParams: the allowed settings, their defaults and checks
with_exact_first(get_verifier("mars"), 16)  # the exact-first window around a lossy rule
"""

from mars_bench.verification import (  # noqa: F401  (registration)
    bild,
    cascade,
    exact_first,
    fly,
    fsd,
    lenient,
    lossy_sd,
    mars,
    mars_ref,
    mentored,
    strict,
    threshold,
    top_m,
    tv_budget,
    typical,
)
from mars_bench.verification.base import (
    COUNT,
    VALUE,
    Decisions,
    NoParams,
    Reason,
    Statistic,
    Verdict,
    Verifier,
    VerifyInput,
    available_verifiers,
    batch_steps,
    get_verifier,
    register_verifier,
    verifier_settings,
)
from mars_bench.verification.exact_first import WINDOW, ExactFirst, verifier_from_settings, with_exact_first
from mars_bench.verification.mars import MarsParams
from mars_bench.verification.mars_ref import MarsRefParams
from mars_bench.verification.typical import TypicalParams

__all__ = [
    "COUNT",
    "VALUE",
    "WINDOW",
    "Decisions",
    "ExactFirst",
    "MarsParams",
    "MarsRefParams",
    "NoParams",
    "Reason",
    "Statistic",
    "TypicalParams",
    "Verdict",
    "Verifier",
    "VerifyInput",
    "available_verifiers",
    "batch_steps",
    "get_verifier",
    "register_verifier",
    "verifier_from_settings",
    "verifier_settings",
    "with_exact_first",
]
