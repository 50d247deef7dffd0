"""Load targets and drafters (dtype, device_map sharding) and check tokenizer compatibility;
chat prompts and stop tokens.

Where the modules go (device plans checked before loading, drafter placement) is
``mars_bench.models.placement``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mars_bench.common.kernels import DEFAULT_KERNELS
from mars_bench.models.cpu_linear import PackedLinears, use_kernels
from mars_bench.models.placement import (
    PLANNED_MAPS,
    DevicePlan,
    check_memory_budget,
    config_before_weights,
    input_device,
    parse_dtype,
    plan_device_map,
)
from mars_bench.models.sources import ResolvedModel, resolve_model

SDPA_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch: SDPA's enable_gqa even with an attention mask


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, where it came from, and how it was placed.

    max_memory: the budget as given (normalised keys), None if none. plan: the device plan
    checked before loading (sharded loads only). kernels: ``model.kernels`` as asked; packed: what
    ``cpu_linear.use_kernels`` packed at load (None: nothing).
    """

    model: Any
    tokenizer: Any
    resolved: ResolvedModel
    dtype: str
    max_memory: dict | None = None
    plan: DevicePlan | None = None
    kernels: str = "stock"
    packed: PackedLinears | None = None

    @property
    def device(self) -> torch.device:
        return input_device(self.model)


def steady_attention_kernels(model: Any) -> None:
    """The attention kernels a decode runs on.

    On CUDA, turn off PyTorch's cuDNN attention backend (SDPA then uses flash or memory-efficient attention).
    cuDNN builds an execution plan for every new key length, and decoding meets a new one
    every step: measured on an H200 with an 8B-shaped Llama, target forwards took 35 ms,
    rising to 100 ms, while the lengths were new and 23 ms once seen. Whichever method
    decodes a prompt first would pay for the plans and flatter the one after it.

    On a CPU-only machine, for a model on the CPU, let SDPA read grouped-query attention's shared key and value heads
    as they are (``enable_gqa``) where transformers would first copy them once per query head (a forward of more than
    one token with an attention mask: a verification, a drafter's multi-token forward; a one-token forward with a mask,
    at B > 1, moves from transformers' packed-query path to the same ``enable_gqa``). The logits are identical, bit for
    bit, except those of a one-token forward at B > 1, equal within float32 rounding (tests/test_attention_kernels.py);
    the copy's cost grows with the context: measured at B = 1 in
    benchmarks/results/spec_step_profile_cpu (about 4% of a decode of a few hundred tokens; B > 1 not timed).
    transformers reads the variable at each call, so every model in the process (a perf suite's transformers peers
    too) runs the same kernel; a value the user set wins. On CUDA, masked GQA would fall back to SDPA's math kernel,
    and other accelerators are left as transformers decides.
    """
    if any(parameter.is_cuda for parameter in model.parameters()):
        torch.backends.cuda.enable_cudnn_sdp(False)
    elif not torch.cuda.is_available() and all(parameter.device.type == "cpu" for parameter in model.parameters()):
        os.environ.setdefault(SDPA_GQA, "1")


def load_model(
    name: str,
    *,
    dtype: str = "bfloat16",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    attn_implementation: str = "sdpa",
    offload_folder: str | Path | None = None,
    kernels: str = DEFAULT_KERNELS,
) -> LoadedModel:
    """Resolve ``name`` (folder or Hub id) and load it for inference (eval mode, no grad).

    device_map: None (the default device), a device ("cpu", "cuda:1"), an explicit map, or
    auto | balanced | balanced_low_0 | sequential: planned against ``max_memory`` on the meta
    device and checked before any weight is read (``plan_device_map``).
    offload_folder: where disk-offloaded weights go (giving one allows disk offload).
    kernels: how linear layers on the CPU compute (``cpu_linear.use_kernels``: auto | onednn | stock).
    """
    torch_dtype = parse_dtype(dtype)
    memory = check_memory_budget(device_map, max_memory)
    folder = None if offload_folder is None else str(offload_folder)
    plan = None
    if device_map in PLANNED_MAPS:
        config = config_before_weights(name)
        if config is not None:
            plan = plan_device_map(name, config, dtype=dtype, device_map=device_map, max_memory=memory, offload_folder=folder)
    resolved = resolve_model(name)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if device_map in PLANNED_MAPS and plan is None:
        config = AutoConfig.from_pretrained(resolved.path)
        plan = plan_device_map(name, config, dtype=dtype, device_map=device_map, max_memory=memory, offload_folder=folder)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation}
    if plan is not None:
        kwargs["device_map"] = plan.device_map  # exactly the plan that was checked
        if "disk" in plan.device_map.values():
            kwargs["offload_folder"] = plan.offload_folder
    elif device_map is not None:
        kwargs["device_map"] = device_map
        if folder is not None:
            kwargs["offload_folder"] = folder
    model = AutoModelForCausalLM.from_pretrained(resolved.path, **kwargs)
    model.eval().requires_grad_(False)
    steady_attention_kernels(model)
    packed = use_kernels(model, kernels)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    return LoadedModel(model, tokenizer, resolved, dtype, memory, plan, kernels, packed)


def check_tokenizers_compatible(target: Any, drafter: Any) -> None:
    """Raise ValueError unless both tokenizers map every token string to the same id."""
    target_vocab, drafter_vocab = target.get_vocab(), drafter.get_vocab()
    if target_vocab == drafter_vocab:
        return
    differing = sorted(set(target_vocab.items()) ^ set(drafter_vocab.items()), key=lambda item: item[1])[:3]
    raise ValueError(
        f"incompatible tokenizers: target has {len(target_vocab)} tokens, drafter {len(drafter_vocab)}, "
        f"first differences {differing}; allowed are drafters whose vocabulary equals the target's"
    )


def stop_token_ids(loaded: LoadedModel) -> list[int]:
    """EOS ids from the generation config and the tokenizer (chat end-of-turn included)."""
    return stop_tokens_of(loaded.tokenizer, getattr(loaded.model.generation_config, "eos_token_id", None))


def stop_tokens_of(tokenizer: Any, eos: int | list[int] | None) -> list[int]:
    """EOS ids: the generation config's ``eos`` (an id, a list or None), the tokenizer's, and the chat
    end-of-turn markers its vocabulary has."""
    ids: set[int] = set()
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        token_id = tokenizer.get_vocab().get(marker)
        if token_id is not None:
            ids.add(token_id)
    return sorted(ids)


def chat_prompt_ids(
    tokenizer: Any,
    turns: list[str] | list[dict[str, str]],
    system_prompt: str | None = None,
    answer_prefix: str = "",
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of a chat prompt ending in the assistant's generation prompt.

    ``turns``: user messages (strings) or whole chat messages ({"role", "content"} dicts).
    ``answer_prefix``: text the assistant's reply begins with, placed in the prompt (the model goes on
    from it: EvalPlus's chat format opens a code fence there). The reply is rendered by the chat template
    with a marker after the prefix and cut at the marker, so the prefix sits exactly where the template
    puts a reply (with its trailing whitespace, which ``continue_final_message`` would strip).
    ``template_kwargs`` go to the chat template (e.g. enable_thinking=False for Qwen3).
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [turn if isinstance(turn, dict) else {"role": "user", "content": turn} for turn in turns]
    if answer_prefix:
        reply = {"role": "assistant", "content": answer_prefix + REPLY_MARKER}
        text = tokenizer.apply_chat_template([*messages, reply], tokenize=False, **template_kwargs)
        if REPLY_MARKER not in text:
            raise ValueError("task.answer_prefix is invalid for this model: its chat template does not render the reply")
        return list(tokenizer(text.split(REPLY_MARKER)[0], add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


REPLY_MARKER = "\u2063<answer goes on here>\u2063"  # where a prefilled reply is cut (text no prompt holds)
