"""core/ports.py: a picked port is free, below the kernel's ephemeral range, and never one already bound."""

from __future__ import annotations

import random
import socket

from eagle3_pipeline.core import ports


class _Picks(random.Random):
    """The ports a test wants picked, in order."""

    def __init__(self, picks: list[int]):
        super().__init__(0)
        self.picks = picks

    def randrange(self, start, stop=None, step=1):  # noqa: ARG002 - random.Random's signature
        return self.picks.pop(0)


def _range_file(tmp_path, lo: int, hi: int):
    f = tmp_path / "ip_local_port_range"
    f.write_text(f"{lo}\t{hi}\n")
    return f


def test_a_port_is_picked_below_the_ephemeral_range_and_is_free(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL", _range_file(tmp_path, 30000, 60999))
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < 30000, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds


def test_a_bound_port_is_never_picked(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL", _range_file(tmp_path, 32768, 60999))
    with socket.socket() as held:
        for port in range(ports.LOWEST, 32768):  # one this test can hold
            try:
                held.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        held.listen()
        taken = held.getsockname()[1]
        other = taken + 1 if taken + 1 < 32768 else taken - 1
        picks = [taken, taken, other]
        assert ports.free_port(rng=_Picks(picks)) == other and picks == []


def test_a_range_that_leaves_no_room_below_it_gets_the_kernels_pick(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL", _range_file(tmp_path, 1024, 65535))
    port = ports.free_port(rng=_Picks([]))  # no pick is asked for: the kernel's, which is in its range
    assert port >= 1024
    monkeypatch.setattr(ports, "EPHEMERAL", tmp_path / "absent")
    assert ports.ephemeral_range() == (32768, 60999)
