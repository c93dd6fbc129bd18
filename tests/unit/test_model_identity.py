"""Model identity by content: a checkpoint rewritten in place with the same names, sizes and even
mtime is another target (a new extract version); an untouched one is identified by a stat."""

from __future__ import annotations

import os
import shutil

import pytest

from eagle3_pipeline.core.store import extract_key, model_fingerprint, weight_digests


@pytest.fixture
def model_copy(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_DIGEST_CACHE", str(tmp_path / "digests.json"))
    d = tmp_path / "model"
    shutil.copytree(tiny_target, d, ignore=shutil.ignore_patterns("corpus"))
    return d


def _scale_layer_in_place(path, layer: int, factor: float) -> None:
    """Decoder layer `layer`'s weights x factor, written back over the same file: same size, same mtime."""
    from safetensors.torch import load_file, save_file

    st = os.stat(path)
    tensors = load_file(str(path))
    for k in tensors:
        if f".layers.{layer}." in k:
            tensors[k] = tensors[k] * factor
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_checkpoint_changed_in_place_is_a_new_target(model_copy):
    before = model_fingerprint(str(model_copy))
    assert model_fingerprint(str(model_copy)) == before  # stable
    key_before = extract_key("tok", before, [2, 4, 5, 8], "bf16", "conn")
    _scale_layer_in_place(model_copy / "model.safetensors", 3, 1.25)
    after = model_fingerprint(str(model_copy))
    assert after != before
    assert extract_key("tok", after, [2, 4, 5, 8], "bf16", "conn") != key_before


def test_unchanged_weights_are_not_read_again(model_copy, monkeypatch):
    from eagle3_pipeline.core import store

    w = model_copy / "model.safetensors"
    first = weight_digests([w])
    reads = []
    monkeypatch.setattr(store, "sha256_file", lambda p, *a: reads.append(p) or "x")
    assert weight_digests([w]) == first and reads == []  # a stat, no read
    w.touch()  # a new ctime: read again
    assert weight_digests([w]) == {w: "x"} and reads == [w]


def test_a_digest_cache_on_a_shared_volume_holds_in_every_pod(model_copy, monkeypatch):
    """The cache on the store (EAGLE3_DIGEST_CACHE=/data/.cache/..., the job templates) is read by pods on other
    nodes, where the same volume has another device number (and, on some filesystems, inode numbers): the
    digest is keyed by path, size, mtime and ctime, so another pod stats the files and reads none of them."""
    from eagle3_pipeline.core import store

    w = model_copy / "model.safetensors"
    first = weight_digests([w])
    real_stat = os.stat

    def other_node(path, *a, **kw):  # the same file through another mount: st_dev and st_ino differ
        st = real_stat(path, *a, **kw)
        fields = list(st)
        fields[1], fields[2] = st.st_ino + 7, st.st_dev + 1  # st_ino, st_dev
        return os.stat_result(fields, {"st_atime_ns": st.st_atime_ns, "st_mtime_ns": st.st_mtime_ns,
                                       "st_ctime_ns": st.st_ctime_ns})

    reads = []
    monkeypatch.setattr(store.os, "stat", other_node)
    monkeypatch.setattr(store, "sha256_file", lambda p, *a: reads.append(p) or "x")
    assert weight_digests([w]) == first and reads == []


def test_the_job_templates_keep_the_digest_cache_on_the_store():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for kind in ("gpu", "cpu"):
        env = json.loads((root / "infra" / f"k8s-{kind}-job-template.json").read_text())["variables"]["properties"]["env"]
        assert env["default"]["EAGLE3_DIGEST_CACHE"].startswith("/data/"), kind  # the store volume, every pod
