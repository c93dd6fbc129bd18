"""A worker for tests/unit/test_forkserver.py: says where and how it runs, then exits with the code it is given,
sleeps, or raises. FORK_PRELOAD names what its fork server imports first."""

import gc
import json
import os
import sys
import time

FORK_PRELOAD = ("json",)


def _proc(name: str) -> list[str]:
    """This process's command line or environment as /proc shows it to others: up to the room's blank end."""
    with open(f"/proc/self/{name}", "rb") as f:
        return f.read().decode(errors="surrogateescape").split("\0\0", 1)[0].rstrip("\0").split("\0")


def main(argv: list[str]) -> int:
    what = argv[0]
    print("fork child: " + json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "cwd": os.getcwd(),
        "path": sys.path,
        "argv": sys.argv[1:], "probe": os.environ.get("EAGLE3_TEST_PROBE"), "cpus": sorted(os.sched_getaffinity(0)),
        "main": sys.modules["__main__"].__spec__.name, "gc_frozen": gc.get_freeze_count(),
        "gc_threshold": gc.get_threshold(), "env": dict(os.environ), "proc_cmdline": _proc("cmdline"),
        "proc_environ": _proc("environ")}), flush=True)
    if what == "sleep":
        time.sleep(120)
    if what == "nap":
        time.sleep(4)
        return 0
    if what == "raise":
        raise ValueError("layer 3 expected [4, 8], found [4]")
    return int(what)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
