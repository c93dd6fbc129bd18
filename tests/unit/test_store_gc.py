"""`eagle3 gc --keep N`: keeps the N newest versions per dataset, removes the others and then the
record-pool files no kept version links; a dry run (the default) lists what it would free and
removes nothing. A store of three versions whose records are hard links into one pool is built by
hand (no engine): version k holds rows r0..r(k+1), so rows are shared between versions."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from typer.testing import CliRunner

ROWS = ["r0", "r1", "r2", "r3"]
SIZE = 1000


def _store(root: Path) -> dict:
    from eagle3_pipeline.records.pool import RecordPool

    ds = root / "chat"
    pool = RecordPool(ds / "pool" / "tiny" / "pk", "pk")
    for r in ROWS:
        pool.record(r).parent.mkdir(parents=True, exist_ok=True)
        pool.record(r).write_bytes(r.encode() * (SIZE // 2))
    orphan = pool.record("ff-orphan")  # linked by no version: collected too
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"x" * SIZE)
    versions = []
    for k in range(3):  # oldest first
        prep = ds / f"prep{k}"
        ex = prep / "tiny" / f"ext{k}"
        (ex / "hidden_states").mkdir(parents=True)
        (ex / "locks").mkdir()
        (ex / "manifest.json").write_text(json.dumps({"content_key": f"ext{k}", "layer_ids": [1, 2], "shards": []}))
        for i, r in enumerate(ROWS[: k + 2]):
            with pool.lock(None):
                pool.link(pool.record(r), ex / "hidden_states" / f"hs_{i}.safetensors")
        (ex / "verify.json").write_text("{}")
        (prep / "tokenized").mkdir()
        (prep / "tokenized" / "data.arrow").write_bytes(b"t" * 300)
        (prep / "prepare.json").write_text("{}")
        t = time.time() - 100 + 10 * k
        os.utime(prep / "prepare.json", (t, t))
        versions.append(prep)
    return {"ds": ds, "pool": pool, "versions": versions}


def test_dry_run_lists_and_removes_nothing(tmp_path):
    from eagle3_pipeline.pipeline.store_gc import gc

    s = _store(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))
    plan = gc(tmp_path, keep=1, log=lambda m: None)
    assert not plan.applied
    assert plan.kept == [str(s["versions"][2])] and plan.removed == [str(v) for v in s["versions"][1::-1]]
    # the kept version links r0..r3: only the orphan pool file goes, plus each removed version's own files
    # (tokenized data, manifest, verify.json, prepare.json)
    assert plan.pool_files == 1 and plan.pool_bytes == SIZE
    own = [p for v in s["versions"][:2] for p in v.rglob("*") if p.is_file() and "hidden_states" not in p.parts]
    assert len(own) == 2 * 4  # prepare.json, tokenized data, manifest.json, verify.json
    assert plan.files == len(own) + 1 and plan.bytes == sum(p.stat().st_size for p in own) + SIZE
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_apply_frees_unreferenced_records_and_keeps_the_newest(tmp_path):
    from eagle3_pipeline.pipeline.store_gc import gc

    s = _store(tmp_path)
    pool, (v0, v1, v2) = s["pool"], s["versions"]
    kept_files = {p: p.read_bytes() for p in v2.rglob("*") if p.is_file()}

    plan = gc(tmp_path, keep=2, apply=True, log=lambda m: None)  # removes v0 (rows r0, r1: still linked by v1, v2)
    assert plan.removed == [str(v0)] and not v0.exists() and v1.exists() and v2.exists()
    assert all(pool.record(r).exists() for r in ROWS) and not pool.record("ff-orphan").exists()
    assert plan.pool_files == 1

    plan = gc(tmp_path, keep=1, apply=True, log=lambda m: None)  # removes v1; v2 links every row
    assert not v1.exists() and all(pool.record(r).exists() for r in ROWS) and plan.pool_files == 0
    assert {p: p.read_bytes() for p in v2.rglob("*") if p.is_file()} == kept_files

    # a version that links only r0, r1 becomes the newest: v2 goes, r2 and r3 leave the pool
    new = s["ds"] / "prep3" / "tiny" / "ext3"
    (new / "hidden_states").mkdir(parents=True)
    (new / "manifest.json").write_text("{}")
    for i, r in enumerate(ROWS[:2]):
        with pool.lock(None):
            pool.link(pool.record(r), new / "hidden_states" / f"hs_{i}.safetensors")
    (s["ds"] / "prep3" / "prepare.json").write_text("{}")
    dry = gc(tmp_path, keep=1, log=lambda m: None)
    assert dry.removed == [str(v2)] and dry.pool_files == 2 and dry.pool_bytes == 2 * SIZE
    done = gc(tmp_path, keep=1, apply=True, log=lambda m: None)
    assert done.pool_files == 2 and not v2.exists()
    assert [pool.record(r).exists() for r in ROWS] == [True, True, False, False]
    assert (new / "hidden_states" / "hs_0.safetensors").read_bytes() == b"r0" * (SIZE // 2)


def test_cli_dry_run_then_apply(tmp_path):
    from flows.cli import app

    s = _store(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["gc", "--keep", "1", "--store", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "dry run" in out.output and "remove 2" in out.output and all(v.exists() for v in s["versions"])
    out = runner.invoke(app, ["gc", "--keep", "1", "--store", str(tmp_path), "--apply"])
    assert out.exit_code == 0, out.output
    assert "gc done" in out.output and not s["versions"][0].exists() and s["versions"][2].exists()
