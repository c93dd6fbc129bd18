"""A refresh costs only what changed (issue 12): a second dataset version with more conversations
extracts only its new rows; the rows both versions share are hard links to one record in the record
pool (pool.py): byte-identical, one inode, disk grows by about the new rows only; verify of
the second version reads only the new records and reuses the first version's per-record results.

Two prepares of the small config (tests/helpers/store.small_overrides) with different source limits,
then extract + verify each: two engine starts, ~1-2 minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.helpers.store import SMALL_ROWS_PER_SOURCE, small_overrides

ROOT = Path(__file__).resolve().parents[2]
MORE = 5  # conversations added per source by the refresh (10 in all)


def _du(root: Path) -> int:
    """Bytes on disk under `root`, each inode counted once (as du does)."""
    seen, total = set(), 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _cfg(tiny_target: Path, store: Path, limit: int):
    from eagle3_pipeline.core.config import load_config

    corpus = tiny_target / "corpus"
    return load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        *small_overrides(tiny_target, store),
        f"prepare.sources=[{{path: {corpus / 'sharegpt.jsonl'}, limit: {limit}}}, "
        f"{{path: {corpus / 'openai.jsonl'}, limit: {limit}}}]",
        "prepare.heldout_fraction=0.15", "extract.invariance_rows=1"])


def _ids_by_row(version) -> dict[int, bytes]:
    from eagle3_pipeline.data.tokenized import load_tokenized

    ds = load_tokenized(version.tokenized_dir)
    return {i: hashlib.sha256(str(ids).encode()).digest() for i, ids in enumerate(ds["input_ids"])}


@pytest.fixture(scope="module")
def refreshed(tiny_target, tmp_path_factory):
    from eagle3_pipeline.pipeline.stages import (
        plan_extract,
        stage_extract,
        stage_preflight,
        stage_prepare,
        stage_verify,
    )

    store = tmp_path_factory.mktemp("refresh-store")
    out = {}
    for name, limit in (("first", SMALL_ROWS_PER_SOURCE), ("second", SMALL_ROWS_PER_SOURCE + MORE)):
        cfg = _cfg(tiny_target, store, limit)
        prep = stage_prepare(cfg, log=lambda m: None)
        version = plan_extract(cfg, prep, stage_preflight(cfg, prep, log=lambda m: None))
        lines: list[str] = []
        ext = stage_extract(cfg, version, log=lines.append)
        ver = stage_verify(cfg, version, log=lines.append)
        out[name] = dict(cfg=cfg, prep=prep, version=version, extract=ext, verify=ver, lines=lines, du=_du(store))
    return out


def test_second_version_extracts_only_new_rows(refreshed):
    a, b = refreshed["first"], refreshed["second"]
    assert a["version"].content_key != b["version"].content_key
    assert a["extract"].rows_extracted == a["version"].rows and a["extract"].rows_reused == 0
    old = set(_ids_by_row(a["version"]).values())
    new_rows = [r for r, h in _ids_by_row(b["version"]).items() if h not in old]
    assert 0 < len(new_rows) < b["version"].rows
    assert b["extract"].rows_extracted == len(new_rows), b["lines"]
    assert b["extract"].rows_reused == b["version"].rows - len(new_rows)
    assert b["extract"].shards_published == b["extract"].shards_total


def test_shared_rows_are_one_file(refreshed):
    """Same bytes and the same inode as the first version's record (and fingerprint) of that row."""
    a, b = refreshed["first"]["version"], refreshed["second"]["version"]
    first = {h: r for r, h in _ids_by_row(a).items()}
    shared = [(first[h], r) for r, h in _ids_by_row(b).items() if h in first]
    assert shared
    for ra, rb in shared:
        pa, pb = a.record_path(ra), b.record_path(rb)
        assert pa.read_bytes() == pb.read_bytes()
        assert os.stat(pa).st_ino == os.stat(pb).st_ino and os.stat(pa).st_nlink >= 3  # a, b and the pool
        assert os.stat(a.fingerprint_path(ra)).st_ino == os.stat(b.fingerprint_path(rb)).st_ino


def test_disk_grows_by_about_the_new_rows(refreshed):
    a, b = refreshed["first"], refreshed["second"]
    v = b["version"]
    old = set(_ids_by_row(a["version"]).values())
    new_rows = [r for r, h in _ids_by_row(v).items() if h not in old]
    new_bytes = sum(v.record_path(r).stat().st_size + v.fingerprint_path(r).stat().st_size for r in new_rows)
    growth = b["du"] - a["du"]
    print(f"store: {a['du']} bytes after the first version ({a['version'].rows} rows), {b['du']} after the second "
          f"({v.rows} rows, {len(new_rows)} new: {new_bytes} bytes of records + fingerprints); growth {growth}")
    # a full second copy would add every record of the second version; what is added is the new records
    # plus the small files of a version (tokenized copy, manifest, logs, verify caches: < 512 KB here)
    assert growth < b["extract"].bytes_on_disk * 0.8, (growth, b["extract"].bytes_on_disk)
    assert growth < new_bytes * 1.1 + 512 * 1024, (growth, new_bytes)


def test_verify_reads_only_new_records(refreshed):
    a, b = refreshed["first"]["verify"], refreshed["second"]["verify"]
    assert a.passed and b.passed
    assert a.rows_rechecked == refreshed["first"]["version"].rows and a.rows_reused == 0
    ext = refreshed["second"]["extract"]
    assert b.rows_rechecked == ext.rows_extracted and b.rows_reused == ext.rows_reused
    assert b.samples_checked == refreshed["second"]["version"].rows  # learned checks still span every row


def test_heldout_conversations_stay_held_out(refreshed):
    import json

    from eagle3_pipeline.data.tokenized import load_tokenized

    held = {}
    train = {}
    for name in ("first", "second"):
        prep = refreshed[name]["prep"]
        held[name] = {json.loads(x)["sample_id"] for x in Path(prep.heldout).read_text().splitlines()}
        train[name] = {sid.split("#")[0] for sid in load_tokenized(prep.tokenized)["sample_id"]}
    # heldout.jsonl lists at most heldout_rows of the held-out conversations (the lowest hashes); none of
    # them is trained on by either version, and no row trained on before became held out
    assert held["first"] and held["second"]
    assert not (held["first"] | held["second"]) & (train["first"] | train["second"])
    assert train["first"] <= train["second"]


def test_rejected_pooled_record_leaves_the_pool(refreshed, tmp_path):
    """Verify moves a bad record away; when it was a link to the pool, the pool forgets it too."""
    from eagle3_pipeline.pipeline.stages import stage_verify
    from eagle3_pipeline.records.pool import row_keys, version_pool
    from eagle3_pipeline.verify.stage import VerifyFailed

    b = refreshed["second"]
    version, pool = b["version"], version_pool(b["version"])
    row = 1
    key = row_keys(version.tokenized_dir, [row], pool.key)[row]
    assert pool.is_pooled(key, version.record_path(row))
    blob = bytearray(version.record_path(row).read_bytes())
    blob[-3:] = b"\xff\xff\x7f"  # garbage in the last values
    tmp = version.record_path(row).with_name("corrupt")
    tmp.write_bytes(bytes(blob))
    os.replace(tmp, version.record_path(row))  # a new inode: the pool's record is untouched...
    os.link(version.record_path(row), tmp)     # ...so make the pool hold the bad one, as an in-place edit would
    os.replace(tmp, pool.record(key))
    with pytest.raises(VerifyFailed):
        stage_verify(b["cfg"], version, log=lambda m: None)
    assert not pool.record(key).exists() and not version.record_path(row).exists()


def test_rows_linked_from_the_pool_have_their_masks_checked(refreshed):
    """A row linked from the pool gets its prepared row's hash when it is linked: verify judges every
    row's tokens and loss mask (reused records' too), and a shifted mask on a linked row fails."""
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.records.shardrun import ShardRun
    from eagle3_pipeline.verify.masks import mask_problems

    b, v = refreshed["second"], refreshed["second"]["version"]
    shards = ShardRun(v.path).read().shards
    assert {int(r) for e in shards if e.status == "published" for r in e.row_hashes} == \
        {r for e in shards if e.status == "published" for r in range(e.row_start, e.row_end)}
    assert b["verify"].checks["masks"].ran and b["verify"].checks["masks"].records == v.rows
    old = set(_ids_by_row(refreshed["first"]["version"]).values())
    linked = [r for r, h in _ids_by_row(v).items() if h in old
              and any(e.status == "published" and e.row_start <= r < e.row_end for e in shards)]
    row = linked[len(linked) // 2]
    ds = load_tokenized(v.tokenized_dir)
    shifted = ds.map(lambda ex, i: {"loss_mask": ex["loss_mask"][1:] + [0]} if i == row else {}, with_indices=True)
    found, bad, checked = mask_problems(shifted, shards, list(range(v.rows)))
    published = sum(e.rows for e in shards if e.status == "published")  # a test above failed a shard
    assert bad == [row] and checked == published and f"(row {row}," in found[0], found
