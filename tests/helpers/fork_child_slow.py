"""A worker whose FORK_PRELOAD takes longer than the test gives a fork server to answer (tests/unit/
test_forkserver.py): the starter gives up on that server and spawns."""

import sys

FORK_PRELOAD = ("tests.helpers.slow_import",)

if __name__ == "__main__":
    print("fork child: spawned", flush=True)
    sys.exit(0)
