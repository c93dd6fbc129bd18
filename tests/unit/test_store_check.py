"""The store check: passes on this machine's disk, refuses object storage and NFS without network
locks by name, and catches each missing property (hard links, atomic rename, flock) when it is taken
away."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3_pipeline.core import store_check as sc
from eagle3_pipeline.core.errors import ExitCode, exit_code

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:41 / /data rw,relatime shared:2 - fuse.gcsfuse my-bucket rw,user_id=0
41 22 0:42 / /nfs rw,relatime shared:3 - nfs4 server:/export rw,vers=4.1,local_lock=none
42 22 0:43 / /nfs3 rw,relatime shared:4 - nfs server:/old rw,vers=3,nolock
43 22 0:44 / /mnt/s3 rw shared:5 - fuse.mountpoint-s3 mountpoint-s3 rw
44 40 0:45 / /data/local rw shared:6 - xfs /dev/sdb1 rw
"""


@pytest.fixture(autouse=True)
def _fresh():
    sc._checked.clear()
    yield
    sc._checked.clear()


def test_passes_here_and_leaves_nothing(tmp_path):
    store = tmp_path / "store"
    sc.check_store(store, log=lambda m: None)
    assert store.is_dir() and list(store.iterdir()) == []


@pytest.mark.parametrize("path,fstype,refused", [
    ("/data/eagle3-store", "fuse.gcsfuse", "object storage"),
    ("/mnt/s3/store", "fuse.mountpoint-s3", "object storage"),
    ("/nfs3/store", "nfs", "nolock"),
    ("/nfs/store", "nfs4", None),         # NFSv4 with network locks is fine
    ("/data/local/store", "xfs", None),   # the longest mount point wins
    ("/home/u/store", "ext4", None),
])
def test_mount_table(path, fstype, refused):
    mount = sc.mount_of(Path(path), MOUNTINFO)
    assert mount.fstype == fstype
    if refused is None:
        sc.refuse_mount(Path(path), mount)
        return
    with pytest.raises(sc.StoreUnfit) as e:
        sc.refuse_mount(Path(path), mount)
    assert refused in str(e.value) and path in str(e.value) and mount.point in str(e.value)
    assert exit_code(e.value) == ExitCode.ENVIRONMENT


def test_no_hard_links_is_refused(tmp_path, monkeypatch):
    def no_link(a, b):
        raise OSError(1, "Operation not permitted")
    monkeypatch.setattr(sc.os, "link", no_link)
    with pytest.raises(sc.StoreUnfit, match="hard links fail"):
        sc.check_store(tmp_path, log=lambda m: None)
    assert [p for p in tmp_path.iterdir()] == []  # the probe is cleaned up


def test_rename_that_copies_is_refused(tmp_path, monkeypatch):
    def copy_not_replace(src, dst):  # what an object-storage FUSE rename may leave: both names
        Path(dst).write_bytes(Path(src).read_bytes())
    monkeypatch.setattr(sc.os, "replace", copy_not_replace)
    with pytest.raises(sc.StoreUnfit, match="not atomic"):
        sc.check_store(tmp_path, log=lambda m: None)


def test_local_only_flock_is_refused(tmp_path, monkeypatch):
    # flock that another process can also take (a lock kept on one host only): the probe child gets it
    monkeypatch.setattr(sc.fcntl, "flock", lambda f, op: None)
    monkeypatch.setattr(sc, "_PROBE", "import sys; sys.exit(3)")
    with pytest.raises(sc.StoreUnfit, match="another process could take a flock"):
        sc.check_store(tmp_path, log=lambda m: None)


def test_refused_before_any_write(tmp_path, monkeypatch):
    store = tmp_path / "bucket"
    monkeypatch.setattr(sc, "mount_of", lambda p, *a: sc.Mount(str(tmp_path), "fuse.s3fs", "bucket", frozenset()))
    with pytest.raises(sc.StoreUnfit, match="fuse.s3fs"):
        sc.check_store(store, log=lambda m: None)
    assert not any(p.name.startswith(".store-check") for p in store.iterdir())
    assert os.listdir(store) == []
