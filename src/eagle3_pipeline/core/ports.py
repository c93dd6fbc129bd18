"""A free TCP port for a server that a child binds seconds later (a vLLM server, a torchrun store, a test's Prefect
server). It is picked below the kernel's ephemeral range, where no other process is handed a port by `bind(0)` or
an outgoing connection, so the port stays free for the child; docs/internals.md, "core/ports.py", has the race.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # below it: well-known and registered services' ports (PostgreSQL 5432, Prefect 4200, 8000s)
PICKS = 64  # tries in the range before the kernel's own pick


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        lo, hi = (int(x) for x in EPHEMERAL.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on `host` now, from [LOWEST, the ephemeral range's start) when that holds any; else the kernel's."""
    lo = ephemeral_range()[0]
    rng = rng or random.SystemRandom()
    for _ in range(PICKS if lo > LOWEST else 0):
        port = rng.randrange(LOWEST, lo)
        if _bindable(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
