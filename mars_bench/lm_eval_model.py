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
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from mars_bench.decoding import decode
from mars_bench.drafting import drafter_for, drafter_needs_model, drafter_settings
from mars_bench.models import check_tokenizers_compatible, load_model, stop_token_ids
from mars_bench.verification import get_verifier, verifier_settings

LM_EVAL_ARGS = {"batch_size", "device", "max_batch_size"}  # lm-eval passes these to every model; decoding is one prompt at a time


@register_model("mars_bench")
class MarsBenchLM(LM):
    """target / draft_model: Hub ids or folders; drafter: model | model_tree | layerskip | lookup | none
    (eagle3 needs a head, which this model does not take); any
    further ``model_args`` are the named drafter's and verifier's own settings (e.g. theta, layers)."""

    def __init__(
        self,
        target: str,
        draft_model: str | None = None,
        drafter: str = "lookup",
        verifier: str = "exact",
        gamma: int = 5,
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
        self.target = load_model(target, dtype=dtype)
        self.drafter = self._drafter(drafter, draft_model, dtype, drafter_keys)
        self.settings = {"gamma": int(gamma), "temperature": float(temperature), "top_p": float(top_p), "seed": int(seed)}
        self.max_new_tokens = int(max_new_tokens)
        self.stops = stop_token_ids(self.target)

    def _drafter(self, name: str, draft_model: str | None, dtype: str, settings: dict[str, Any]) -> Any:
        small = None
        if drafter_needs_model(name):
            if not draft_model:
                raise ValueError(f"drafter={name} needs draft_model=<Hub id or folder>")
            small = load_model(draft_model, dtype=dtype)
            check_tokenizers_compatible(self.target.tokenizer, small.tokenizer)
        return drafter_for(name, self.target.model, small.model if small else None, tokenizer=self.target.tokenizer, **settings)

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
            **self.settings,
        )
        text = self.target.tokenizer.decode(result.tokens, skip_special_tokens=True)
        cut = min((text.find(stop) for stop in until if stop and stop in text), default=len(text))
        return text[:cut]

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        raise NotImplementedError("mars_bench scores generative tasks only (generate_until)")

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise NotImplementedError("mars_bench scores generative tasks only (generate_until)")


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
