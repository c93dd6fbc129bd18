"""Only failed shards re-run: a fault in one shard fails its group's task; running the flow again
executes only that group (the others are answered from Prefect's cache, as the task states show).
Three shards of one group each (30 rows; four until issue 53 cut an engine start): the failed one in the
middle, a shard on each side of it that must stay untouched, the last one forced again at the end."""

import json
from pathlib import Path


def _task_states(flow_state) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])))
    return {r.name: r.state.name for r in runs}


def test_retry_runs_only_the_failed_shard_group(tiny_config, tiny_target, prefect_harness, tmp_path, monkeypatch):
    from eagle3_pipeline.extract.worker import FAIL_SHARDS_ENV
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_preflight, stage_prepare
    from flows.extract import extract

    corpus = tiny_target / "corpus"
    cfg = tiny_config.model_copy(deep=True)
    cfg.store = str(tmp_path / "store")
    cfg.prepare.sources[0].path, cfg.prepare.sources[0].limit = str(corpus / "openai.jsonl"), 30
    cfg.prepare.sources = cfg.prepare.sources[:1]
    cfg.prepare.heldout_rows = 0
    cfg.extract.rows_per_shard, cfg.extract.shards_per_group, cfg.extract.retries = 10, 1, 0
    prep = stage_prepare(cfg)
    version = plan_extract(cfg, prep, stage_preflight(cfg, prep))

    monkeypatch.setenv(FAIL_SHARDS_ENV, "1")  # shard 1 fails once, like a lost node
    first = extract(cfg, version, return_state=True)
    assert first.is_failed() and "shards [1]" in first.message
    s1 = _task_states(first)
    assert s1["extract-shards-[1]"] == "Failed"
    assert all(s1[f"extract-shards-[{k}]"] == "Completed" for k in (0, 2))

    second = extract(cfg, version, return_state=True)  # the retry
    assert second.is_completed()
    s2 = _task_states(second)
    assert s2["extract-shards-[1]"] == "Completed"
    assert all(s2[f"extract-shards-[{k}]"] == "Cached" for k in (0, 2)), s2
    rec = second.result()
    assert rec.shards_published == rec.shards_total == 3 and rec.content_key == version.content_key
    manifest = json.loads(Path(rec.manifest).read_text())
    assert [s["attempts"] for s in manifest["shards"]] == [1, 2, 1]

    third = extract(cfg, version, force_shards=[2], return_state=True)  # force re-extracts chosen shards
    s3 = _task_states(third)
    assert s3["extract-shards-[2]"] == "Completed" and s3["extract-shards-[0]"] == "Cached"
    assert [s["attempts"] for s in json.loads(Path(rec.manifest).read_text())["shards"]] == [1, 2, 2]
