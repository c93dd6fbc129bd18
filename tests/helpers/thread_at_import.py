"""Starts a thread when imported (a library that starts a pool at import): tests/unit/test_forkserver.py."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
