"""Run untrusted (model-written) Python in a separate, limited process; never in ours.

Protections, each recorded in the result: a fresh temporary working folder that is also
HOME; an environment holding only PATH, HOME and LANG (no secrets from ours); resource
limits on address space, processes, file size, CPU time and core dumps; a wall-clock
time-out after which the whole process group and every process of the sandbox user is
killed. Run as root (as on this project's machines) it also gets a fresh network
namespace (no network, not even loopback) and a throw-away user id, so it cannot write
outside its folder or signal our processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
INTERPRETERS = ("/usr/bin/python3", "/usr/local/bin/python3")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_file_bytes: int = 16 << 20
    output_chars: int = 4000  # of stdout and stderr kept in the result


@dataclass
class ExecutionResult:
    status: str  # passed | failed | timeout
    returncode: int | None
    seconds: float
    stdout: str = ""
    stderr: str = ""
    protections: list[str] = field(default_factory=list)
    sandbox_uid: int | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def world_executable(path: str) -> bool:
    """Whether any user may run ``path`` (every folder above it traversable by others)."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)


def interpreter_for(sandbox_uid: int | None) -> str:
    candidates = [sys.executable, *INTERPRETERS]
    if sandbox_uid is None:
        return sys.executable
    for candidate in candidates:
        if world_executable(candidate):
            return os.path.realpath(candidate)
    raise RuntimeError(f"no Python interpreter that an unprivileged user may run among {candidates}")


def user_processes(uid: int) -> list[int]:
    """Live (non-zombie) processes owned by ``uid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


KILL_ALL_AS = "import os, sys; u = int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u); os.kill(-1, 9)"


def kill_user_processes(uid: int, attempts: int = 20) -> None:
    """Kill every process of the sandbox user, forks in flight included.

    ``kill(-1)`` sent *as that user* reaches all of its processes in one system call, which
    a fork bomb cannot outrun the way a scan-then-kill loop can.
    """
    for _ in range(attempts):
        if not user_processes(uid):
            return
        subprocess.run([sys.executable, "-I", "-c", KILL_ALL_AS, str(uid)], check=False)
    raise RuntimeError(f"sandbox: processes of uid {uid} survived {attempts} kill rounds")


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> ExecutionResult:
    """Execute ``source`` as a Python program in the sandbox; status ``passed`` iff it exits 0 in time."""
    is_root = os.geteuid() == 0
    uid = random.randint(200_000, 900_000) if is_root else None
    folder = Path(tempfile.mkdtemp(prefix="mars_bench_sandbox_"))
    program = folder / "program.py"
    program.write_text(source, encoding="utf-8")
    protections = ["own folder as cwd and HOME", "scrubbed environment", "rlimits", "time-out kills the process group"]
    if uid is not None:
        os.chown(folder, uid, uid)
        os.chown(program, uid, uid)
        folder.chmod(0o700)
        protections += ["throw-away uid", "fresh network namespace (no network)"]
    spec = {
        "isolate_network": is_root,
        "uid": uid,
        "python": interpreter_for(uid),
        "program": str(program),
        "env": {"PATH": "/usr/bin:/bin", "HOME": str(folder), "LANG": "C.UTF-8"},
        "limits": {
            "RLIMIT_AS": limits.memory_bytes,
            "RLIMIT_NPROC": limits.max_processes,
            "RLIMIT_FSIZE": limits.max_file_bytes,
            "RLIMIT_CPU": int(limits.timeout_s) + 1,
            "RLIMIT_CORE": 0,
        },
    }
    if not is_root:  # an unprivileged RLIMIT_NPROC counts all of our own processes
        del spec["limits"]["RLIMIT_NPROC"]
    started = time.perf_counter()
    # Output goes to files we keep open and read back by descriptor: the program may rename
    # or replace the paths in its folder, but cannot redirect what we read.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            [sys.executable, "-I", str(LAUNCHER), json.dumps(spec)],
            cwd=folder,
            env=spec["env"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            returncode: int | None = process.wait(timeout=limits.timeout_s)
            status = "passed" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            returncode, status = None, "timeout"
        finally:
            _kill_everything(process, uid)
        seconds = time.perf_counter() - started
        stdout, stderr = _tail(out, limits.output_chars), _tail(err, limits.output_chars)
    shutil.rmtree(folder, ignore_errors=True)
    return ExecutionResult(status, returncode, seconds, stdout, stderr, protections, uid)


def _kill_everything(process: subprocess.Popen, uid: int | None) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    if uid is not None:
        kill_user_processes(uid)


def _tail(handle, chars: int) -> str:
    """The last ``chars`` characters written to an open binary file."""
    size = handle.seek(0, os.SEEK_END)
    handle.seek(max(0, size - chars * 4))
    return handle.read().decode("utf-8", errors="replace")[-chars:]


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program HumanEval runs: the prompt, the completion, the tests and the check call."""
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"


__all__ = ["ExecutionResult", "SandboxLimits", "humaneval_program", "run_python"]
