"""Sharded targets (mars_bench/models/placement.py): a model split by device_map / max_memory decodes token
for token like the unsplit one through the engine; a plan that does not fit fails before any
weight is read, in one line; the manifest records where target and drafter were placed.

This machine has no GPU, so the split is accelerate's CPU + disk offload: the layers past the
CPU budget live in safetensors files and accelerate's hooks load them for every forward.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from mars_bench.bench.manifest import build_manifest
from mars_bench.decoding import decode
from mars_bench.drafting import drafter_for
from mars_bench.models.loading import load_model
from mars_bench.models.placement import (
    drafter_device,
    input_device,
    model_size_bytes,
    normalise_max_memory,
    placement,
    plan_device_map,
)

VOCAB = 96
PROMPT = [1, 5, 9, 2, 7, 3, 3, 40, 41]
# The tiny fp32 model is ~0.63 MB (a decoder layer ~0.15 MB); accelerate keeps one layer's size
# free on the main device, so a 400 kB CPU budget holds the embeddings and one layer only.
SPLIT_MEMORY = {"cpu": "400KB", "disk": "1GB"}


def save_tiny(folder, kind: str, seed: int = 0, layers: int = 4):
    """A tiny random model with a word-level tokenizer, saved as a loadable folder."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tiny_model(kind, seed=seed, layers=layers, vocab=VOCAB).save_pretrained(folder)
    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="t1").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Offloaded weights are fresh tensors every forward; on a busy 2-core machine each op's
    OpenMP wake-up then costs a scheduler slice (~30 ms). One thread keeps this file fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target_dir = save_tiny(root / "target", request.param)
    whole = load_model(target_dir, dtype="float32")
    split = load_model(target_dir, dtype="float32", device_map="auto", max_memory=SPLIT_MEMORY, offload_folder=root / "offload")
    place = str(drafter_device(split.model))
    drafters = {
        "other": load_model(save_tiny(root / "other", "llama", seed=7, layers=2), dtype="float32", device_map=place),
        "same": load_model(target_dir, dtype="float32", device_map=place),  # accepts every draft
    }
    return whole, split, drafters


def test_the_split_really_spans_cpu_and_disk(models):
    _, split, _ = models
    device_map = split.model.hf_device_map
    assert set(device_map.values()) == {"cpu", "disk"}
    assert device_map["model.embed_tokens"] == "cpu" and device_map["lm_head"] == "disk"
    offloaded = split.model.model.layers[-1].self_attn.q_proj
    assert offloaded.weight.device.type == "meta" and hasattr(offloaded, "_hf_hook")  # loaded by the hook per forward
    assert input_device(split.model) == torch.device("cpu")


@pytest.mark.slow
def test_the_split_decodes_like_the_whole_model(models):
    whole, split, drafters = models
    expected = decode(whole.model, None, None, PROMPT, max_new_tokens=24, temperature=0.0).tokens
    assert decode(split.model, None, None, PROMPT, max_new_tokens=24, temperature=0.0).tokens == expected
    for label, draft in drafters.items():
        for target in (whole, split):
            drafter = drafter_for("model", target.model, draft.model)
            result = decode(target.model, drafter, "exact", PROMPT, max_new_tokens=24, gamma=4, temperature=0.0)
            assert result.tokens == expected, label
            if label == "same":
                assert result.accepted == result.drafted > 0  # the rollback path and the accept path both ran


def test_a_plan_that_does_not_fit_fails_before_loading(tmp_path):
    folder = save_tiny(tmp_path / "target", "llama")
    with pytest.raises(ValueError) as error:
        load_model(folder, dtype="float32", device_map="auto", max_memory={"cpu": "300KB"})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"model {folder} does not fit: it needs 0.0005973 GiB in float32")
    assert "max_memory={'cpu': '300KB'} allows 0.0002794 GiB" in message
    assert "to disk" in message and "raise model.max_memory" in message and "'disk' entry" in message


def test_offload_is_allowed_only_when_asked_for(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(save_tiny(tmp_path / "target", "llama"))
    size = model_size_bytes(config, "float32")
    assert size == 641344  # fp32, untied head: (96*64*2 + 4 * 37_056 + 64) params * 4 bytes
    assert abs(model_size_bytes(config, "bfloat16") - size // 2) <= 64  # the rotary buffer stays fp32
    roomy = plan_device_map("tiny", config, dtype="float32", device_map="auto", max_memory={"cpu": "10MB"})
    assert set(roomy.device_map.values()) == {"cpu"} and roomy.offloaded == {}
    by_folder = plan_device_map(
        "tiny", config, dtype="float32", device_map="sequential", max_memory={"cpu": "400KB"}, offload_folder="/tmp/x"
    )
    assert "disk" in by_folder.device_map.values() and by_folder.offloaded["disk"] > 0


def test_max_memory_keys_and_values_are_checked():
    assert normalise_max_memory({"0": "70GiB", "cuda:1": "70GiB", "CPU": 10**9}) == {0: "70GiB", 1: "70GiB", "cpu": 10**9}
    with pytest.raises(ValueError, match="model.max_memory key 'gpu0' is invalid"):
        normalise_max_memory({"gpu0": "1GiB"})
    with pytest.raises(ValueError, match=r"model.max_memory\['cpu'\]='lots' is invalid"):
        normalise_max_memory({"cpu": "lots"})
    with pytest.raises(ValueError, match="allowed with max_memory are auto"):
        load_model("unused", max_memory={"cpu": "1GiB"})


def test_an_absent_accelerator_is_refused(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(save_tiny(tmp_path / "target", "llama"))
    absent = torch.cuda.device_count()  # one past the last accelerator this machine has
    with pytest.raises(ValueError, match=f"names accelerator {absent} for tiny, but this machine has {absent}"):
        plan_device_map("tiny", config, dtype="float32", device_map="auto", max_memory={absent: "1GiB", "cpu": "1GiB"})


def test_the_manifest_records_target_and_drafter_placement(models):
    _, split, drafters = models
    manifest = build_manifest({}, {"target": split, "drafter": drafters["other"]}, {"seed": 0})
    target, drafter = manifest["models"]["target"], manifest["models"]["drafter"]
    assert target["placement"]["device_map"] == {name: str(place) for name, place in split.model.hf_device_map.items()}
    assert target["placement"]["input_device"] == "cpu" and target["placement"]["offloaded_modules"]["disk"] >= 1
    assert target["max_memory"] == SPLIT_MEMORY
    assert (
        target["plan"]["size_bytes"] == model_size_bytes(split.model.config, "float32")
        and target["plan"]["offloaded_bytes"]["disk"] > 0
    )
    assert drafter["placed_with"]["device"] == drafter["placed_with"]["target_input_device"] == "cpu"
    assert drafter["max_memory"] is None and drafter["placement"]["input_device"] == "cpu"
    assert placement(split.model) == target["placement"]
