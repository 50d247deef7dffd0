"""An lm-evaluation-harness model whose ``generate_until`` runs our speculative decoder.

    mars-bench-lm-eval run --model mars_bench \
        --model_args target=HuggingFaceTB/SmolLM2-135M-Instruct,drafter=lookup,verifier=mars,KEY=VALUE \
        --include_path examples/lm_eval --tasks gsm8k_local --limit 5

(``KEY=VALUE``: any setting of the named verifier or drafter, by the name its settings class declares;
docs/tasks.md#lm-eval gives the command with the ``mars`` rule's threshold.)

``mars-bench-lm-eval`` is lm-eval's own command line with this model registered (plain
``lm_eval`` knows only the models it ships; from Python, importing this module registers
``mars_bench`` for ``lm_eval.simple_evaluate``). Generative tasks only: log-likelihood
requests are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import fields
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from mars_bench.backends import PreparedMethod, Requests, check_backend_config, make_backend
from mars_bench.config.backend import backend_config
from mars_bench.config.schema import ModelConfig
from mars_bench.decoding import DecodeResult
from mars_bench.decoding.draft_length import DraftLengthSettings
from mars_bench.decoding.stop_strings import StopStrings
from mars_bench.decoding.tally import DecodeTally
from mars_bench.drafting import drafter_needs_model, drafter_settings
from mars_bench.method import MethodSpec
from mars_bench.verification import WINDOW, verifier_settings
from mars_bench.verification.sampling import SamplingParams

LOG = logging.getLogger(__name__)
LM_EVAL_ARGS = {"device", "max_batch_size"}  # lm-eval passes these to every model (and batch_size, which is used)
LENGTH_KEYS = {item.name for item in fields(DraftLengthSettings)}  # the draft length, as the app's drafter.* keys
SAMPLING_KEYS = {"temperature", "top_p"}  # model_args' sampling defaults (top_k there is the tree drafters' setting)
GEN_KWARGS_USED = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}  # after normalize_gen_kwargs


@register_model("mars_bench")
class MarsBenchLM(LM):
    """target / draft_model: Hub ids or folders; drafter: model | model_tree | layerskip | lookup | none
    (eagle3 needs a head, which this model does not take); gamma, length, max_gamma, min_confidence
    and draft_cost: the draft length, as the app's ``drafter.*`` keys; temperature and top_p: the
    sampling unless a task's ``gen_kwargs`` set it; any further ``model_args`` are the named
    drafter's and verifier's own settings, by the names their settings classes declare
    (``drafter_settings(drafter)``, ``verifier_settings(verifier)``: e.g. layers, draft_vocab, weights),
    so a verifier registered later takes its own without an edit here; backend: the registered backend that
    loads the models and decodes (``mars_bench/backends``, as ``backend=`` in the app; default transformers, this
    package's engine), built from the app's run config of the method (``backend_config``).

    lm-eval's ``--batch_size B`` decodes up to B consecutive requests of the same ``gen_kwargs`` together
    in the one engine; 1 decodes each alone, as a batch of one."""

    def __init__(
        self,
        target: str,
        draft_model: str | None = None,
        drafter: str = "lookup",
        verifier: str = "exact",
        dtype: str = "bfloat16",
        max_new_tokens: int = 256,
        seed: int = 0,
        batch_size: int | str = 1,
        backend: str = "transformers",
        **settings: Any,
    ) -> None:
        super().__init__()
        self.spec = lm_eval_spec(drafter, verifier, settings)  # every value checked before any model loads
        self.batch_size = check_batch_size(batch_size)
        if drafter_needs_model(self.spec.drafter) and not draft_model:
            raise ValueError(f"drafter={self.spec.drafter} needs draft_model=<Hub id or folder>")
        self.max_new_tokens, self.seed = int(max_new_tokens), int(seed)
        model = ModelConfig(name=target, target=target, draft_model=draft_model, dtype=dtype)
        cfg = backend_config(self.spec, model, backend, seed=self.seed, batch_size=self.batch_size)
        check_backend_config(cfg, self.spec)
        self.backend = make_backend(cfg)
        self.stops = self.backend.stop_token_ids
        loaded = self.backend.models().get("target")
        self.target_name = str(loaded.resolved.name) if loaded is not None else target
        self.methods: dict[SamplingParams, PreparedMethod] = {}
        self.method(self.spec)  # the drafter and verifier built now: what cannot be built fails before any request

    def method(self, spec: MethodSpec) -> PreparedMethod:
        """``spec`` (this model's method at one request's sampling) prepared on the backend, once per sampling."""
        if spec.sampling not in self.methods:
            self.methods[spec.sampling] = self.backend.prepare(str(spec.verifier), spec)
        return self.methods[spec.sampling]

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (the backend's)."""
        return self.backend.tokenizer

    @property
    def tokenizer_name(self) -> str:
        return self.target_name.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Every request in order, with a progress bar in requests showing tok/s and tau so far; at the
        end one line on stderr with what the decodes added up to (``DecodeTally.line``)."""
        from tqdm import tqdm

        outputs, tally = [], DecodeTally()
        with tqdm(total=len(requests), desc="mars_bench", unit="request", disable=disable_tqdm) as bar:
            for contexts, gen_kwargs in request_batches(requests, self.batch_size):
                for text, result in self.decode_requests(contexts, gen_kwargs):
                    outputs.append(text)
                    tally.add(result)
                    bar.update(1)
                bar.set_postfix_str(tally.postfix(), refresh=False)
        print(tally.line(), file=sys.stderr)
        return outputs

    def generate(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        """The answer to one request (``decode_request``)."""
        return self.decode_request(context, gen_kwargs)[0]

    def decode_request(self, context: str, gen_kwargs: dict[str, Any]) -> tuple[str, DecodeResult]:
        """One request, as lm-eval's HF model serves it: the task's ``until`` strings (and the end-of-text
        token's text) end decoding as they appear and cut the answer; ``max_gen_toks`` (or an alias) is the
        budget (default: ``max_new_tokens``); the task's sampling settings win over ``model_args``.
        Returns the answer and the decode that made it."""
        return self.decode_requests([context], gen_kwargs)[0]

    def decode_requests(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> list[tuple[str, DecodeResult]]:
        """Requests of the same ``gen_kwargs``, as ``decode_request`` serves one: alone (one context),
        or together in one call of the backend, each row with the seed it has alone."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_new_tokens)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.eos_text)
        ignored = sorted(set(kwargs) - GEN_KWARGS_USED)
        if ignored:
            LOG.warning("mars_bench ignores the gen_kwargs %s", ", ".join(ignored))
        method = self.method(self.spec.with_sampling(request_sampling(gen_kwargs, self.spec.sampling)))
        prompts = [self.tokenizer(context, add_special_tokens=False)["input_ids"] for context in contexts]
        stop = StopStrings(self.tokenizer, tuple(until))
        requests = Requests(prompts, [self.seed] * len(prompts), int(kwargs["max_gen_toks"]), self.stops, stop)
        results = self.backend.generate(method, requests)
        texts = [self.tokenizer.decode(result.tokens, skip_special_tokens=True) for result in results]
        return [(postprocess_generated_text(text, until, None), result) for text, result in zip(texts, results)]

    @property
    def eos_text(self) -> str | None:
        """The end-of-text token's text, which lm-eval's HF model adds to every request's stop strings."""
        eos = self.tokenizer.eos_token_id
        return None if eos is None else self.tokenizer.decode([eos], skip_special_tokens=False)

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        raise NotImplementedError("mars_bench scores generative tasks only (generate_until)")

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise NotImplementedError("mars_bench scores generative tasks only (generate_until)")


def check_batch_size(batch_size: int | str) -> int:
    """lm-eval's ``--batch_size`` as an integer >= 1 (ValueError in one line otherwise: ``auto`` too)."""
    text = str(batch_size)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"batch_size={text!r} is invalid: allowed is an integer >= 1")
    return int(text)


def request_batches(requests: list[Any], size: int) -> list[tuple[list[str], dict[str, Any]]]:
    """The requests in order, as runs of up to ``size`` consecutive ones with equal ``gen_kwargs``: (contexts, gen_kwargs)."""
    batches: list[tuple[list[str], dict[str, Any]]] = []
    for request in requests:
        context, gen_kwargs = request.args
        gen_kwargs = dict(gen_kwargs or {})
        if batches and len(batches[-1][0]) < size and batches[-1][1] == gen_kwargs:
            batches[-1][0].append(context)
        else:
            batches.append(([context], gen_kwargs))
    return batches


def request_sampling(gen_kwargs: dict[str, Any], default: SamplingParams) -> SamplingParams:
    """The sampling of one request: ``model_args``' (``default``) where the task sets nothing, else the
    task's, read as lm-eval reads them: ``do_sample: false`` is greedy; ``do_sample: true`` samples at the
    task's temperature, or the model's where it is greedy, then 1 (transformers' default); a temperature
    without ``do_sample`` samples when it is above 0. ``top_p`` and ``top_k`` from the task win too."""
    do_sample, temperature = gen_kwargs.get("do_sample"), gen_kwargs.get("temperature")
    if do_sample is False:
        temperature = 0.0
    elif do_sample is True:
        temperature = float(temperature) if temperature is not None else (default.temperature or 1.0)
    else:
        temperature = default.temperature if temperature is None else float(temperature)
    return SamplingParams(temperature, float(gen_kwargs.get("top_p", default.top_p)), int(gen_kwargs.get("top_k", default.top_k)))


def lm_eval_spec(drafter: str, verifier: str, settings: dict[str, Any]) -> MethodSpec:
    """The method that ``model_args`` describe: the draft length, the sampling defaults and the named
    drafter's and verifier's own settings, sorted as each declares them. Any other key is refused in
    one line that names the allowed ones; ``None``/``null`` mean None."""
    drafter_keys = {item.name for item in fields(drafter_settings(drafter))}
    verifier_keys = {item.name for item in fields(verifier_settings(verifier))} | {WINDOW}  # and its exact-first window
    unknown = sorted(set(settings) - drafter_keys - verifier_keys - LENGTH_KEYS - SAMPLING_KEYS - LM_EVAL_ARGS)
    if unknown:
        allowed = ", ".join(sorted(drafter_keys | verifier_keys)) or "none"
        raise ValueError(f"unknown model_args {', '.join(unknown)} for drafter={drafter}, verifier={verifier}: "
                         f"their settings are {allowed}")  # fmt: skip
    values = {key: None if value in ("None", "null") else value for key, value in settings.items()}

    def picked(keys: set[str]) -> dict[str, Any]:
        return {key: values[key] for key in keys & set(values)}

    length = dataclasses.replace(DraftLengthSettings(), **picked(LENGTH_KEYS))
    sampling = dataclasses.replace(SamplingParams(), **{key: float(value) for key, value in picked(SAMPLING_KEYS).items()})
    return MethodSpec.create(drafter, verifier, drafter_settings=picked(drafter_keys), verifier_settings=picked(verifier_keys),
                             length=length, sampling=sampling)  # fmt: skip


def cli() -> None:
    """lm-eval's command line, with the ``mars_bench`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    cli()
