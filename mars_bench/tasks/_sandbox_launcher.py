"""Runs inside the sandbox's child process (our code, not the program under test):
drop into a fresh network namespace, set resource limits, switch to the sandbox user,
then exec the interpreter on the program. Arguments: one JSON object."""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNET = 0x40000000


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["isolate_network"]:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            sys.exit(f"sandbox: cannot isolate the network (errno {ctypes.get_errno()})")
    for name, value in spec["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    uid = spec["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.execve(spec["python"], [spec["python"], "-I", "-B", spec["program"]], spec["env"])


main()
