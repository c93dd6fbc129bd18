"""The run store's contract, proved on the store path before a stage writes to it.

More: docs/internals.md, "core/store_check.py".
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.core.errors import EnvironmentProblem

DOCS = "docs/store.md (the store's requirements)"
# FUSE filesystems that present object storage: no flock across hosts, rename is copy + delete.
OBJECT_STORAGE = {"fuse.s3fs", "fuse.gcsfuse", "fuse.goofys", "fuse.mountpoint-s3", "fuse.rclone", "fuse.blobfuse",
                  "fuse.blobfuse2", "fuse.s3backer", "fuse.geesefs", "fuse.cloudstorage", "fuse.azureblob"}
# NFS options under which flock only locks on this host.
NFS_LOCAL_LOCKS = {"nolock", "local_lock=all", "local_lock=flock"}
# A child that must find the file locked: exit 0 = could not lock (good), 3 = locked it (flock is local).
_PROBE = ("import fcntl,sys\nf=open(sys.argv[1],'rb')\ntry:\n fcntl.flock(f,fcntl.LOCK_EX|fcntl.LOCK_NB)\n"
          "except BlockingIOError:\n sys.exit(0)\nsys.exit(3)")


class StoreUnfit(EnvironmentProblem):
    """The store path lacks a property the run store relies on; the message says which and where."""


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str
    options: frozenset[str]


def mount_of(path: Path, mountinfo: str | None = None) -> Mount | None:
    """The mount holding `path` (the longest mount point that prefixes it), from /proc/self/mountinfo."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target, best = str(path), None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            opts = set(fields[5].split(",")) | set(tail[2].split(",") if len(tail) > 2 else [])
            best = Mount(point, tail[0], tail[1], frozenset(opts))
    return best


def refuse_mount(path: Path, mount: Mount | None) -> None:
    """Object storage or NFS without network locks under `path`: StoreUnfit naming the mount."""
    if mount is None:
        return
    where = f"store {path} is on {mount.point} ({mount.fstype} from {mount.source})"
    if mount.fstype in OBJECT_STORAGE or (mount.fstype.startswith("fuse.") and "s3" in mount.fstype):
        raise StoreUnfit(f"{where}: object storage behind FUSE has no flock across hosts and no atomic rename; "
                         f"use a POSIX RWX volume (NFSv4, CephFS, Lustre, GPFS, a local disk) - {DOCS}")
    local = sorted(NFS_LOCAL_LOCKS & mount.options)
    if mount.fstype.startswith("nfs") and local:
        raise StoreUnfit(f"{where} mounted with {','.join(local)}: flock then locks on this host only; "
                         f"mount with network locking (NFSv4, or lockd for NFSv3) - {DOCS}")


def _try_properties(path: Path) -> None:
    probe = path / f".store-check-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    probe.mkdir(parents=True)
    try:
        a, b = probe / "a", probe / "b"
        a.write_bytes(b"1")
        try:
            os.link(a, b)
        except OSError as e:
            raise StoreUnfit(f"store {path}: hard links fail ({e}); published records are hard links - {DOCS}") from None
        if os.stat(a).st_ino != os.stat(b).st_ino or os.stat(a).st_nlink != 2:
            raise StoreUnfit(f"store {path}: a hard link is not the same file (inode or link count) - {DOCS}")
        tmp = probe / "c.tmp"
        tmp.write_bytes(b"2")
        os.replace(tmp, a)
        if a.read_bytes() != b"2" or tmp.exists() or b.read_bytes() != b"1":
            raise StoreUnfit(f"store {path}: rename over an existing file is not atomic replacement - {DOCS}")
        with open(a, "rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            rc = subprocess.run([sys.executable, "-c", _PROBE, str(a)], timeout=60).returncode
        if rc != 0:
            raise StoreUnfit(f"store {path}: another process could take a flock this process holds "
                             f"(probe exit {rc}); shard and group locks would not exclude - {DOCS}")
    finally:
        for p in probe.iterdir():
            p.unlink()
        probe.rmdir()


_checked: set[str] = set()


def check_store(path: Path, log=print) -> None:
    """Prove the store's properties on `path` (created if missing) once per process; StoreUnfit if not."""
    path = Path(path).resolve()
    if str(path) in _checked:
        return
    path.mkdir(parents=True, exist_ok=True)
    mount = mount_of(path)
    refuse_mount(path, mount)
    _try_properties(path)
    _checked.add(str(path))
    if mount is not None and mount.fstype.startswith(("nfs", "fuse", "ceph", "lustre", "gpfs")):
        log(f"store {path}: {mount.fstype} on {mount.point}: flock, hard links and atomic rename work")
