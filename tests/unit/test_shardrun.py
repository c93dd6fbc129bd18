"""shardrun.py without an engine: the typed manifest reads today's files back unchanged, and a shard
run's attempts open, publish, close and are recovered as extract and regenerate rely on."""

import pytest

from eagle3_pipeline.records.shardrun import ShardManifest, ShardRun, engine_start_since, hashes, published_ok

EXTRACT = {
    "format_version": 1, "content_key": "k", "config": {"extract": {"fingerprints": True}, "target": {}},
    "tools": {"vllm": "0.1", "torch": None}, "layer_ids": [1, 2], "num_rows": 4, "rows_per_shard": 2,
    "children": [{"attempt": 1, "owner": "h:1", "shards": [0, 1], "started_at": "2030-01-01T00:00:00Z",
                  "status": "ok", "scratch": "/s/extract-1", "seconds": 3.5, "engine_start_s": 1.25,
                  "published": [0, 1], "error": None}],
    "shards": [{"index": 0, "row_start": 0, "row_end": 2, "status": "published", "attempts": 1, "tokens": 9,
                "bytes": 10, "seconds": 0.5, "phases": {"rows": 0.1}, "files": {"hs_0.safetensors": "ab"},
                "fingerprints": {}, "error": None, "extracted_rows": 2, "reused_rows": 0, "published_at": 5.0,
                "extracted_tokens": 9, "row_hashes": {"0": "cd"}},
               {"index": 1, "row_start": 2, "row_end": 4, "status": "pending", "attempts": 0, "tokens": 0,
                "bytes": 0, "seconds": 0.0, "phases": None, "files": {}, "fingerprints": {}, "error": None,
                "reused_rows": 0, "extracted_rows": 0}],
    "invariance": {"3": {"layers": [], "attempt": 1}}, "updated_at": "2030-01-01T00:00:09Z"}
REGENERATE = {
    "format_version": 1, "regenerate_format": 1, "content_key": "v", "lineage": {"source_rows": 3},
    "single_pass": False, "single_pass_reason": "two passes", "output_token_states": True, "children": [],
    "shards": [{"index": 0, "row_start": 0, "row_end": 3, "input_sha": "ef", "status": "published", "attempts": 1,
                "error": None, "rows_sha256": "aa", "quarantine_sha256": "bb", "rows_in": 3, "rows_out": 2,
                "rows_quarantined": 1, "quarantine_kinds": {"length": 1}, "rounds": 1, "first_difference": None,
                "generate_s": 1.5, "seconds": 2.0}]}


@pytest.mark.parametrize("data", [EXTRACT, REGENERATE, {"content_key": "o", "online_sample": True, "shards": [],
                                                        "rows": [1], "endpoint": "http://x"}, {}])
def test_typed_manifest_reads_todays_files_back_unchanged(data):
    m = ShardManifest.model_validate(data)
    assert m.model_dump(mode="json", exclude_unset=True) == data


def test_typed_manifest_reads_fields_of_either_stage():
    m = ShardManifest.model_validate(EXTRACT)
    assert [s.index for s in m.published()] == [0] and m.children[0].engine_start_s == 1.25
    assert m.shards[0].rows == 2 and m.shards[0].row_hashes == {"0": "cd"}
    r = ShardManifest.model_validate(REGENERATE).shards[0]
    assert r.count("rows_out") == 2 and r.count("first_difference") == 0 and r.quarantine_sha256 == "bb"


def _run(tmp_path) -> ShardRun:
    run = ShardRun(tmp_path, "extract", ValueError)
    run.ensure("k", lambda m: None if m else {"content_key": "k", "children": [], "shards": [
        {"index": k, "row_start": 2 * k, "row_end": 2 * k + 2, "status": "pending", "attempts": 0, "error": None}
        for k in range(3)]})
    return run


def test_attempt_opens_running_publishes_and_closes(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(ValueError, match="belongs to content key 'k'"):
        run.ensure("other", lambda m: None)
    a = run.open_attempt([0, 1], scratch=lambda n: tmp_path / f"s-{n}")
    m = run.read()
    assert a.number == 1 and m.children[0].status == "running" and m.children[0].scratch == str(tmp_path / "s-1")
    assert [s.status for s in m.shards] == ["running", "running", "pending"] and m.shards[0].attempts == 1
    f = tmp_path / "rows-0"
    f.write_text("x")
    run.publish(0, {"files": hashes({"rows-0": f})})
    a.published.add(0)
    a.engine_s.append(2.0)
    a.errors[1] = "publishing shard 1 failed: boom"
    run.close_attempt(a, "child failed")
    m = run.read()
    assert [s.status for s in m.shards] == ["published", "failed", "pending"]
    assert m.shards[1].error == "publishing shard 1 failed: boom" and m.shards[0].published_at is not None
    c = m.children[0]
    assert (c.status, c.published, c.engine_start_s, c.error) == ("failed", [0], 2.0, "child failed")
    assert published_ok({f: m.shards[0].files["rows-0"]}) is None
    f.write_text("y")
    assert "no longer hashes" in published_ok({f: m.shards[0].files["rows-0"]})
    assert "is missing" in published_ok({tmp_path / "gone": "00"})
    assert engine_start_since(tmp_path, 0) == 2.0


def test_abandoned_attempt_is_recovered_for_its_shards_only(tmp_path):
    run = _run(tmp_path)
    run.open_attempt([0])
    run.open_attempt([2])
    seen = []
    assert run.recover_abandoned([1], seen.append) == [] and seen == []  # nothing of shard 1's was running
    found = run.recover_abandoned([0, 1], seen.append)
    assert [c.attempt for c in found] == [1] and [c.attempt for c in seen] == [1]
    m = run.read()
    assert m.children[0].status == "failed" and m.children[0].error.startswith("abandoned")
    assert m.children[1].status == "running"  # shard 2's attempt belongs to another holder
    assert [s.status for s in m.shards] == ["failed", "pending", "running"]
    assert m.shards[0].error == "abandoned: child attempt 1 never finished"


def test_missing_manifest(tmp_path):
    with pytest.raises(FileNotFoundError):
        ShardRun(tmp_path).read()
    assert ShardRun(tmp_path).read(missing_ok=True).shards == []
