"""Takes 30 s to import (tests/unit/test_forkserver.py)."""

import time

time.sleep(30)
