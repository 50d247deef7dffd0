"""Claims on work that many processes, on many nodes over a shared filesystem, share.

A *claim* is a file naming its owner (host, process, SLURM job, time), created whole by exactly
one of the processes racing for it (``mars_bench.common.files.atomic_create``: no ``flock``, which is
unreliable or missing on network filesystems). Its modification time is the owner's heartbeat.
A claim is *stale*, and may be broken, when its owner is a process of this host that no longer
runs, when it belongs to this very SLURM job (a requeued job taking its own work back), or when
its heartbeat is older than the lease.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from mars_bench.common.files import atomic_create

LEASE_S = 3600.0  # a claim whose owner has not touched it for this long is given up


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
