"""AMX on Linux: a process must ask the kernel before it runs an AMX tile instruction.

More: docs/internals.md, "engine/cpu_isa.py".
"""

from __future__ import annotations

import ctypes
import platform

ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64


def _xcomp(op: int) -> int | None:
    """The feature mask ARCH_GET_XCOMP_SUPP / _PERM reports; None where the call is not available."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_ulong(0)
        if libc.syscall(SYS_ARCH_PRCTL, op, ctypes.byref(mask)) != 0:
            return None
        return mask.value
    except (OSError, AttributeError):
        return None


def amx_supported() -> bool:
    """The CPU and the kernel offer AMX tile data to processes that ask."""
    supp = _xcomp(ARCH_GET_XCOMP_SUPP)
    return bool(supp and supp >> XFEATURE_XTILEDATA & 1)


def amx_permitted() -> bool:
    """This process may run AMX tile instructions now."""
    perm = _xcomp(ARCH_GET_XCOMP_PERM)
    return bool(perm and perm >> XFEATURE_XTILEDATA & 1)


def allow_amx() -> bool:
    """Ask the kernel for AMX tile data in this process (idempotent, never raises). Returns whether
    AMX is permitted afterwards; False where the CPU has none."""
    if not amx_supported():
        return False
    if amx_permitted():
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        return False
    return rc == 0 and amx_permitted()  # rc -1: e.g. ENOSPC, an alternate signal stack too small for AMX state
