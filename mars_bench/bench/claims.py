"""Files that many processes, on many nodes over a shared filesystem, create beside each other.

Nothing here uses ``flock``: POSIX locks are unreliable or missing on network filesystems. A file
is created whole or not at all by writing a private temporary file and hard-linking it to its
final name; ``link`` fails when the name exists, on local disks and NFS alike, so of several
processes creating the same name exactly one wins and every reader sees a complete file.

A *claim* is such a file naming its owner (host, process, SLURM job, time). Its modification
time is the owner's heartbeat. A claim is *stale*, and may be broken, when its owner is a process
of this host that no longer runs, when it belongs to this very SLURM job (a requeued job taking
its own work back), or when its heartbeat is older than the lease.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LEASE_S = 3600.0  # a claim whose owner has not touched it for this long is given up


def private_copy(path: Path, data: bytes) -> Path:
    """``data`` written and synced to a temporary file beside ``path``, named for this host, process and moment."""
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    with temporary.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return temporary


def atomic_create(path: Path, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists; True if this call created it."""
    temporary = private_copy(path, data)
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink(missing_ok=True)


def atomic_replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole: readers see the old file or the new one, never a part."""
    os.replace(private_copy(path, data), path)


def owner() -> dict[str, Any]:
    """Who this process is, as a claim records it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": slurm_job(), "since": time.time()}


def slurm_job() -> str | None:
    """This process's SLURM job (array jobs: job_task), the same again after a requeue; None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def running(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust the signal test
    return state not in ("Z", "X")


class Claim:
    """A claim file at ``path``: taken by one process at a time, broken when stale."""

    def __init__(self, path: Path, lease_s: float = LEASE_S) -> None:
        self.path, self.lease_s = path, lease_s
        self.held = False

    def take(self) -> bool:
        """Take the claim if it is free or stale; True if this process holds it now."""
        if self.held:
            return True
        for _ in range(2):  # a stale claim is broken once, then taken like a free one
            if atomic_create(self.path, json.dumps(owner()).encode()):
                self.held = True
                return True
            if not self.stale():
                return False
            self.path.unlink(missing_ok=True)
        return False

    def holder(self) -> dict[str, Any] | None:
        """The owner the claim file names; None when there is none (or it vanished while read)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def stale(self) -> bool:
        holder = self.holder()
        if holder is None:
            return not self.path.exists()
        me = owner()
        if holder.get("host") == me["host"] and holder.get("pid") != me["pid"] and not running(int(holder.get("pid", 0))):
            return True  # its process died (killed, preempted) on this host
        if me["job"] is not None and holder.get("job") == me["job"] and holder.get("pid") != me["pid"]:
            return True  # this SLURM job, requeued: its own claim from before
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return True
        return age > self.lease_s

    def beat(self) -> None:
        """Renew the lease (the claim's modification time)."""
        if self.held:
            os.utime(self.path)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def wait(self, poll_s: float = 2.0, done: Any = None) -> None:
        """Return once the claim is free or stale, or ``done()`` is true."""
        while self.path.exists() and not self.stale():
            if done is not None and done():
                return
            time.sleep(poll_s)
