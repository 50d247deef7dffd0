"""Every entry point decodes through the backend seam. The perf suite's methods and the lm-eval model's requests
reach a backend registered by name (``register_backend``), built from the app's run config of their method
(``backend_config``: ``method_spec`` of it is their method), as a sweep cell's do. And the perf suite's timed path
does the work a direct call of the engine does: the same tokens, the same model forwards, the same host reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from conftest import SHARED_DATA, HostSyncs

from mars_bench.backends import PreparedMethod, Requests, TransformersBackend, register_backend
from mars_bench.config.backend import backend_config
from mars_bench.config.method import method_spec
from mars_bench.config.schema import ModelConfig
from mars_bench.decoding import DecodeResult, decode
from mars_bench.lm_eval_model import MarsBenchLM, lm_eval_spec
from mars_bench.method import MethodSpec
from mars_bench.perf.costs import ForwardTimer
from mars_bench.perf.suite import OURS, DraftConfig, Method, PerfSettings, Suite, run_suite

BUILT: list[Any] = []  # the run config of every RecordingBackend built
CALLS: list[tuple[PreparedMethod, Requests, list[DecodeResult]]] = []  # every generate call it answered


class RecordingBackend(TransformersBackend):
    """The transformers backend, registered under its own name, keeping its run configs and its calls."""

    name: ClassVar[str] = "entry_points_recording"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        BUILT.append(cfg)

    def generate(self, method: PreparedMethod, requests: Requests) -> list[DecodeResult]:
        results = super().generate(method, requests)
        CALLS.append((method, requests, results))
        return results


@pytest.fixture(scope="module")
def recording() -> type[RecordingBackend]:
    register_backend(RecordingBackend.name, RecordingBackend)
    return RecordingBackend


@pytest.fixture(scope="module")
def tiny_draft(tiny_target, tmp_path_factory) -> Path:
    """A draft model for ``tiny_target``: its tokenizer, 2 layers of other weights (a model of its own, whose forwards
    hooks tell apart from the target's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_draft")
    config = AutoConfig.from_pretrained(tiny_target)
    config.num_hidden_layers = 2
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(folder)
    return folder


def tiny_settings(target: Path, draft: Path, **keys: Any) -> PerfSettings:
    """The perf suite on the tiny pair: 2 GSM8K prompts, 6 new tokens, drafts of 2, no peers."""
    configs = (DraftConfig.of("model", "fixed"), DraftConfig.of("model", "schedule", guesses=1))
    settings = {"dtype": "float32", "tasks": ("gsm8k",), "num_prompts": 2, "max_new_tokens": 6, "repeats": 1, "gamma": 2,
                "temperatures": (0.0, 1.0), "peers": (), "data_dir": str(SHARED_DATA), "configurations": configs}  # fmt: skip
    return PerfSettings(target=str(target), draft_model=str(draft), **{**settings, **keys})


def test_the_run_config_of_an_entry_points_method_builds_that_method_as_the_app_builds_it():
    settings = tiny_settings(Path("t"), Path("d"), gamma=4, min_confidence=0.6,
                             configurations=(DraftConfig.of("model", "confidence", draft_vocab=32768, weights="int4",
                                                            guesses=3, context_vocab=True),))  # fmt: skip
    specs = [settings.spec(settings.configs()[0], temperature) for temperature in settings.temperatures]
    specs += [lm_eval_spec("layerskip", "mars", {"layers": 3, "theta": 0.8, "length": "schedule", "temperature": 0.7}),
              lm_eval_spec("model", "mars", {"theta": 0.8, "exact_first": 4}),
              lm_eval_spec("model_tree", "rejection", {"top_k": 2, "tree_tokens": 8, "gamma": 3})]  # fmt: skip
    for spec in specs:
        cfg = backend_config(spec, ModelConfig(target="t", draft_model="d"), "transformers", seed=3)
        assert method_spec(cfg) == spec and (cfg.backend, cfg.seed, cfg.model.target) == ("transformers", 3, "t")
    with pytest.raises(ValueError, match="^backend_config needs a method with a verifier"):
        backend_config(MethodSpec(), ModelConfig())


def test_the_perf_suite_refuses_a_backend_that_is_not_this_packages_engine_before_anything_loads():
    register_backend("entry_points_elsewhere", lambda cfg: None)  # a factory: a backend that declares no engine of ours
    with pytest.raises(ValueError, match=r"^backend='entry_points_elsewhere' is invalid: the suite times this package's"):
        PerfSettings(target="t", draft_model="d", backend="entry_points_elsewhere").check()
    with pytest.raises(ValueError, match=r"^backend='nope' is unknown: allowed are "):
        PerfSettings(target="t", draft_model="d", backend="nope").check()
    with pytest.raises(ValueError, match=r"^drafter='model_tree' is invalid: .* allowed are model$"):
        PerfSettings(target="t", draft_model="d", drafter="model_tree").check()


@pytest.mark.slow  # several seconds: the suite's forward costs and its decodes on the tiny pair
def test_the_perf_suites_methods_are_decoded_by_a_backend_registered_by_name(recording, tiny_target, tiny_draft):
    settings = tiny_settings(tiny_target, tiny_draft, backend=recording.name)
    BUILT.clear()
    CALLS.clear()
    report = run_suite(settings)
    cfg, = BUILT  # one backend for every method, built from the run config of the first
    assert method_spec(cfg) == settings.spec(settings.configs()[0], 0.0) and cfg.backend == recording.name
    assert (cfg.model.target, cfg.model.draft_model, cfg.model.dtype) == (str(tiny_target), str(tiny_draft), "float32")
    methods = {method.name: method for method in _ours(settings)}
    assert sorted({method.label for method, _, _ in CALLS}) == sorted(methods)  # every one of our methods, no other
    for name, method in methods.items():
        calls = [(prepared, requests, results) for prepared, requests, results in CALLS if prepared.label == name]
        assert all(prepared.spec == settings.spec(method.config, method.temperature) for prepared, _, _ in calls)
        # a warm-up (seed 0, 8 tokens), then each prompt alone with its seed, in a batch of one
        assert [(list(r.seeds), r.max_new_tokens) for _, r, _ in calls] == [([0], 8), ([0], 6), ([1], 6)]
        timed = [results[0] for _, _, results in calls[1:]]
        assert [run["tokens"] for run in report["raw"][name][0]] == [len(result.tokens) for result in timed]
        assert report["results"][name]["forwards"]["target_forwards_per_token"] > 0
        if method.config is not None:  # the draft model's forwards, counted apart from the target's
            assert report["results"][name]["forwards"]["drafter_forwards_per_target_forward"] > 0
    assert report["version"] == 2 and report["settings"]["backend"] == recording.name


def _ours(settings: PerfSettings) -> list[Method]:
    from mars_bench.perf.suite import methods_for

    return [method for method in methods_for(settings) if method.side == OURS]


@pytest.mark.slow  # a few seconds: the tiny pair's decodes, each twice
def test_the_perf_suites_timed_path_does_the_engines_work_and_no_more(tiny_target, tiny_draft):
    settings = tiny_settings(tiny_target, tiny_draft, configurations=(DraftConfig.of("model", "fixed"),))
    suite = Suite(settings)
    try:
        prompt = suite.prompts[0]
        for method in _ours(settings):
            spec = settings.spec(method.config, method.temperature)
            drafter = spec.build_drafter(suite.target.model, suite.draft.model, tokenizer=suite.backend.tokenizer)
            with ForwardTimer(suite.target.model) as target, ForwardTimer(suite.draft.model) as draft, HostSyncs() as syncs:
                direct = decode(suite.target.model, drafter, spec.build_verifier(), prompt, max_new_tokens=6,
                                stop_token_ids=suite.stops, seed=5, **spec.decode_kwargs())  # fmt: skip
            with HostSyncs() as timed_syncs:
                run = suite.ours(method, prompt, 5, 6)
            assert run["tokens"] == direct.tokens, method.name
            assert (run["target_forwards"], run["drafter_forwards"]) == (target.calls, draft.calls), method.name
            assert target.calls > 0 and (draft.calls > 0) == (method.config is not None)
            assert timed_syncs.calls == syncs.calls and syncs.count > 0, method.name  # the same host reads, by function
            assert run["steps"] == direct.verify_steps and run["drafted"] == direct.drafted
    finally:
        suite.close()


@pytest.mark.slow  # a few seconds: the tiny pair's decodes
def test_the_lm_eval_models_requests_are_decoded_by_a_backend_registered_by_name(recording, tiny_target, tiny_draft):
    BUILT.clear()
    CALLS.clear()
    lm = MarsBenchLM(target=str(tiny_target), draft_model=str(tiny_draft), drafter="model", verifier="exact",
                     dtype="float32", backend=recording.name, batch_size=2, seed=4, gamma=2)  # fmt: skip
    cfg, = BUILT
    assert method_spec(cfg) == lm.spec and (cfg.seed, cfg.batch_size, cfg.backend) == (4, 2, recording.name)
    contexts = [lm.apply_chat_template([{"role": "user", "content": f"Count to {n}."}]) for n in (3, 4, 5)]
    requests = [SimpleNamespace(args=(context, {"until": [], "max_gen_toks": 5})) for context in contexts]
    answers = lm.generate_until(requests, disable_tqdm=True)
    assert [len(r.prompts) for _, r, _ in CALLS] == [2, 1]  # lm-eval's batch size: two together, then the third
    assert all(method.spec == lm.spec and r.max_new_tokens == 5 and set(r.seeds) == {4} for method, r, _ in CALLS)
    texts = [lm.tokenizer.decode(result.tokens, skip_special_tokens=True) for _, _, results in CALLS for result in results]
    assert answers == texts
