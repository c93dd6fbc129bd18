"""A worker whose FORK_PRELOAD starts a thread in the importing process (tests/unit/test_forkserver.py): a fork
server must refuse to fork it."""

import sys

FORK_PRELOAD = ("tests.helpers.thread_at_import",)

if __name__ == "__main__":
    print("fork child: spawned", flush=True)
    sys.exit(0)
