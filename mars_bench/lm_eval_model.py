"""An lm-evaluation-harness model whose ``generate_until`` runs our speculative decoder.

    mars-bench-lm-eval run --model mars_bench \
        --model_args target=HuggingFaceTB/SmolLM2-135M-Instruct,drafter=lookup,verifier=mars,theta=0.9 \
        --include_path examples/lm_eval --tasks gsm8k_local --limit 5

``mars-bench-lm-eval`` is lm-eval's own command line with this model registered (plain
``lm_eval`` knows only the models it ships; from Python, importing this module registers
``mars_bench`` for ``lm_eval.simple_evaluate``). Generative tasks only: log-likelihood
requests are refused.
"""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from mars_bench.config import max_draft_depth
from mars_bench.decoding import decode
from mars_bench.decoding.draft_length import confidence_stop, draft_length_policy
from mars_bench.drafting import build_settings, drafter_for, drafter_needs_model, drafter_settings
from mars_bench.drafting.model import check_min_confidence
from mars_bench.models import check_tokenizers_compatible, load_model, stop_token_ids
from mars_bench.verification import get_verifier, verifier_settings

LM_EVAL_ARGS = {"batch_size", "device", "max_batch_size"}  # lm-eval passes these to every model; decoding is one prompt at a time


@register_model("mars_bench")
class MarsBenchLM(LM):
    """target / draft_model: Hub ids or folders; drafter: model | model_tree | layerskip | lookup | none
    (eagle3 needs a head, which this model does not take); gamma, length, max_gamma and
    min_confidence: the draft length, as the app's ``drafter.*`` keys; any further ``model_args``
    are the named drafter's and verifier's own settings (e.g. theta, layers, draft_vocab, weights)."""

    def __init__(
        self,
        target: str,
        draft_model: str | None = None,
        drafter: str = "lookup",
        verifier: str = "exact",
        gamma: int = 5,
        length: str = "fixed",
        max_gamma: int = 16,
        min_confidence: float = 0.4,
        dtype: str = "bfloat16",
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        seed: int = 0,
        **settings: Any,
    ) -> None:
        super().__init__()
        drafter_keys, verifier_keys = split_settings(drafter, verifier, settings)
        self.verifier = get_verifier(verifier, **verifier_keys)
        self.draft_length = draft_length_settings(drafter, drafter_keys, int(gamma), length, int(max_gamma))
        confidence = confidence_stop(length, min_confidence)
        check_min_confidence(confidence)
        self.target = load_model(target, dtype=dtype)
        self.drafter = self._drafter(drafter, draft_model, dtype, drafter_keys, confidence)
        self.settings = {"gamma": int(gamma), "temperature": float(temperature), "top_p": float(top_p), "seed": int(seed)}
        self.max_new_tokens = int(max_new_tokens)
        self.stops = stop_token_ids(self.target)

    def _drafter(self, name: str, draft_model: str | None, dtype: str, settings: dict[str, Any],
                 min_confidence: float | None) -> Any:  # fmt: skip
        small = None
        if drafter_needs_model(name):
            if not draft_model:
                raise ValueError(f"drafter={name} needs draft_model=<Hub id or folder>")
            small = load_model(draft_model, dtype=dtype)
            check_tokenizers_compatible(self.target.tokenizer, small.tokenizer)
        return drafter_for(name, self.target.model, small.model if small else None, tokenizer=self.target.tokenizer,
                           min_confidence=min_confidence, **settings)  # fmt: skip

    @property
    def tokenizer_name(self) -> str:
        return str(self.target.resolved.name).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.target.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.target.tokenizer.chat_template if chat_template else None

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            outputs.append(self.generate(context, dict(gen_kwargs or {})))
        return outputs

    def generate(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        prompt = self.target.tokenizer(context, add_special_tokens=False)["input_ids"]
        result = decode(
            self.target.model,
            self.drafter,
            self.verifier,
            prompt,
            max_new_tokens=int(gen_kwargs.get("max_gen_toks", self.max_new_tokens)),
            stop_token_ids=self.stops,
            draft_length=draft_length_policy(*self.draft_length),  # a fresh one per sequence: schedule adapts
            **self.settings,
        )
        text = self.target.tokenizer.decode(result.tokens, skip_special_tokens=True)
        cut = min((text.find(stop) for stop in until if stop and stop in text), default=len(text))
        return text[:cut]

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        raise NotImplementedError("mars_bench scores generative tasks only (generate_until)")

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise NotImplementedError("mars_bench scores generative tasks only (generate_until)")


def draft_length_settings(drafter: str, drafter_keys: dict[str, Any], gamma: int, length: str,
                          max_gamma: int) -> tuple[str, int, int]:  # fmt: skip
    """(policy, gamma, deepest draft) for ``draft_length_policy``, checked before any model loads;
    a tree drafts no deeper than its node budget holds, as in the app (``config.max_draft_depth``)."""
    tree_tokens = getattr(build_settings(drafter, **drafter_keys), "tree_tokens", None)
    deepest = max_draft_depth(SimpleNamespace(name=drafter, max_gamma=max_gamma, tree_tokens=tree_tokens))
    draft_length_policy(length, gamma, deepest)
    return length, gamma, deepest


def split_settings(drafter: str, verifier: str, settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort ``model_args`` beyond the fixed ones into the drafter's and the verifier's settings, as
    each declares them; any other key is refused in one line that names the allowed ones."""
    drafter_keys = {item.name for item in fields(drafter_settings(drafter))}
    verifier_keys = {item.name for item in fields(verifier_settings(verifier))}
    unknown = sorted(set(settings) - drafter_keys - verifier_keys - LM_EVAL_ARGS)
    if unknown:
        allowed = ", ".join(sorted(drafter_keys | verifier_keys)) or "none"
        raise ValueError(f"unknown model_args {', '.join(unknown)} for drafter={drafter}, verifier={verifier}: "
                         f"their settings are {allowed}")  # fmt: skip
    values = {key: None if value in ("None", "null") else value for key, value in settings.items()}
    return ({key: values[key] for key in drafter_keys & set(values)}, {key: values[key] for key in verifier_keys & set(values)})


def cli() -> None:
    """lm-eval's command line, with the ``mars_bench`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    cli()
