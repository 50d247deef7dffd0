"""Files written whole or not at all, safe for many processes on many nodes over a shared filesystem.

Nothing here uses ``flock``: POSIX locks are unreliable or missing on network filesystems. A file
is written to a private temporary file beside its final name (named for the host, process and
moment), synced, then moved into place: ``os.replace`` swaps it in whole, and ``os.link`` fails
when the name exists, on local disks and NFS alike, so of several processes creating the same
name exactly one wins. Either way every reader sees a complete file. Torch-free: the records'
writers (``bench``), the drafting caches and the analysis all use it.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path


def private_copy(path: Path, data: bytes) -> Path:
    """``data`` written and synced to a temporary file beside ``path``, named for this host, process and moment."""
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        with temporary.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk or an interrupt leaves no temporary behind
        raise
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
    temporary = private_copy(path, data)
    try:
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # gone already unless the replace failed
