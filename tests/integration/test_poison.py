"""A failed gate poisons nothing (issue 49): the target's forward computes one request in 20 with its positions
reversed (tests/helpers/forward_corruption.py), upstream of every engine-side record, so only a recomputation sees
it. Verify fails, says how far the damage goes (spread over the version: the engine computes wrongly), and
condemns every record that engine wrote: out of the record pool, every shard failed. The engine is then "fixed"
without any config change (as a vLLM fix or a replaced node would), and extract and verify run again on the same
store: no record the failed engine wrote is left to be trained on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.forward_corruption import EVERY_ENV, MODE_ENV, corrupted

ROOT = Path(__file__).resolve().parents[2]
EVERY = 20


def test_a_failed_verify_keeps_nothing_the_failed_engine_wrote(tiny_target, tmp_path, monkeypatch):
    import datasets

    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.stages import (
        plan_extract,
        stage_extract,
        stage_preflight,
        stage_prepare,
        stage_verify,
    )
    from eagle3_pipeline.records.shardrun import ShardRun
    from eagle3_pipeline.verify.stage import VerifyFailed

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(EVERY_ENV, str(EVERY))
    monkeypatch.setenv(MODE_ENV, "reversed")  # the mode the per-row prediction signal missed
    corpus = tiny_target / "corpus"
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        f"store={tmp_path / 'store'}", f"target.model={tiny_target}",
        f"prepare.sources=[{{path: {corpus / 'sharegpt.jsonl'}, limit: 70}}, {{path: {corpus / 'openai.jsonl'}, limit: 70}}]",
        "prepare.heldout_rows=4", "extract.rows_per_shard=16", "verify.reference_samples=48", "verify.escalate_rows=64",
        "extract.connector_module=tests.helpers.forward_corruption", "extract.connector_name=ForwardCorruptionConnector"])
    lines: list[str] = []
    log = lines.append
    prep = stage_prepare(cfg, log=log)
    version = plan_extract(cfg, prep, stage_preflight(cfg, prep, log=log))
    stage_extract(cfg, version, log=log)
    tok = datasets.load_from_disk(prep.tokenized)
    bad = {i for i, ids in enumerate(tok["input_ids"]) if corrupted(ids, EVERY)}
    assert bad, "no corrupted request in this slice"
    from eagle3_pipeline.core.store import sha256_file

    written = {p.stat().st_ino for p in version.hidden_states_dir.glob("hs_*.safetensors")}
    before = {i: sha256_file(version.record_path(i)) for i in range(len(tok))}
    assert len(written) == len(tok)

    with pytest.raises(VerifyFailed) as err:
        stage_verify(cfg, version, log=log)
    v = json.loads(version.verify_path.read_text())
    ext = v["extent"]
    assert ext["verdict"] == "spread", ext
    assert str(err.value).splitlines()[1].strip().startswith("extent: ")  # the gate's message opens with the extent
    assert ext["ci95"][0] <= len(bad) / len(tok) <= ext["ci95"][1], (ext, len(bad), len(tok))
    assert set(v["bad_rows"]) <= bad and ext["escalated"] > 0  # every row named is bad; the hit shards recomputed
    assert ext["reextract_rows"] == len(tok) and "would reproduce it" in ext["says"]
    man = ShardRun(version.path).read()
    assert {s.status for s in man.shards} == {"failed"}
    pooled = {p.stat().st_ino for p in Path(version.pool_dir).rglob("*.safetensors") if "verify" not in p.parts}
    assert not pooled & written, "records the failed engine wrote are still in the record pool"
    assert not (version.path / "verify_rows.safetensors").exists() or not json.loads(
        version.verify_path.read_text())["passed"]

    monkeypatch.setenv(EVERY_ENV, str(1 << 62))  # the engine is fixed; the config is not changed
    again = plan_extract(cfg, prep, stage_preflight(cfg, prep, log=log))
    assert again.content_key == version.content_key and again.pool_dir == version.pool_dir
    stage_extract(cfg, again, log=log)
    res = stage_verify(cfg, again, log=log)
    assert res.passed and res.rows_reused == 0
    shards = ShardRun(again.path).read().shards
    assert all(s.status == "published" and s.reused_rows == 0 and s.extracted_rows == s.rows for s in shards), \
        [(s.index, s.reused_rows, s.extracted_rows) for s in shards]  # every row computed again, none linked
    changed = {i for i in range(len(tok)) if sha256_file(again.record_path(i)) != before[i]}
    assert bad <= changed, sorted(bad - changed)  # the rows the failed engine computed wrongly are new records
