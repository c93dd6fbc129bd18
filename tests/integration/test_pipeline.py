"""The whole pipeline on the tiny default, through the Prefect flow, against a real (temporary)
Prefect server: real vLLM extraction and EAGLE-3 decoding, real speculators training.

The session's run (`pipeline_run`) also carries issue 15's checks, so that they cost no run of their
own: the draft is trained by two processes (`train.world_size=2`: torchrun, DDP over gloo on CPU), and
one transient fault is injected into each stage with a retry policy (faults.py; RETRY_POLICIES in
tasks/stage_tasks.py, delays set to 0 here): the run must complete through Prefect's retries."""

import json
from pathlib import Path

import pytest

RETRIED = ("prepare", "verify", "vocab", "train", "evaluate")  # faults.FAULT_POINTS
# What no assertion of this module reads, off in its run (issue 53 item 8): evaluate's n-gram and suffix-decoding
# baselines (two more engine loads in the evaluate child, ~10 s), covered by tests/integration/test_evaluate.py and
# test_evaluate_sets.py. Its sampled pass and speed-up (asserted here) stay on.
EVALUATE_UNREAD = {"baseline_ngram": False, "baseline_suffix": False}


@pytest.fixture(scope="session")
def pipeline_state(tiny_config, prefect_harness, tmp_path_factory):
    """(run dir, report.json, final flow state) of the tiny default with world_size 2 and one injected
    transient fault per stage of RETRIED."""
    import tasks.stage_tasks as t
    from eagle3_pipeline.core.faults import FAIL_ONCE_DIR_ENV, FAIL_ONCE_ENV
    from eagle3_pipeline.report.runs import create_run_dir
    from flows.pipeline import pipeline

    cfg = tiny_config.model_copy(deep=True)
    cfg.train.world_size = 2
    cfg.evaluate = cfg.evaluate.model_copy(update=EVALUATE_UNREAD)
    run_dir = create_run_dir(tmp_path_factory.mktemp("runs"), cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAIL_ONCE_ENV, ",".join(RETRIED))
        mp.setenv(FAIL_ONCE_DIR_ENV, str(tmp_path_factory.mktemp("fault-markers")))
        for name in RETRIED:  # the policies' counts and conditions, without their waits
            mp.setattr(getattr(t, name), "retry_delay_seconds", 0)
        state = pipeline(config=cfg, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return run_dir, json.loads((run_dir / "report.json").read_text()), state


@pytest.fixture(scope="session")
def pipeline_run(pipeline_state):
    return pipeline_state[:2]


def test_report_contract_and_numbers(pipeline_run, tiny_config):
    run_dir, rep = pipeline_run
    assert rep["status"] == "completed" and rep["error"] is None
    assert set(rep) >= {"run_id", "config", "versions", "stages", "artifacts"}
    st = rep["stages"]
    assert set(st) >= {"prepare", "extract", "verify", "vocab", "train", "evaluate"}
    prep, ext, ver = st["prepare"], st["extract"], st["verify"]
    assert prep["rows_in"] == prep["rows_out"] + prep["details"]["rows_heldout"] + prep["rows_quarantined"]
    assert ext["layer_ids"] == [2, 4, 5, 8]
    assert ext["shards_published"] == ext["shards_total"] >= 2
    assert ver["passed"] and ver["samples_checked"] == prep["rows_out"]
    assert ver["reference_max_rel_err"] is not None and ver["reference_max_rel_err"] < 0.1
    n_files = len(list(Path(rep["artifacts"]["hidden_states"]).glob("hs_*.safetensors")))
    assert n_files == prep["rows_out"]
    assert st["vocab"]["draft_vocab_size"] == tiny_config.vocab.draft_vocab_size
    assert st["train"]["steps"] > 0 and st["train"]["final_loss"] is not None
    ev = st["evaluate"]
    assert len(ev["per_position_acceptance"]) == tiny_config.evaluate.num_speculative_tokens
    assert ev["acceptance_length"] > ev["acceptance_length_untrained"] >= 1.0
    # the configured categorized prompt set (evaluate.prompts of tiny-cpu.yaml, 16 prompts taken round-robin
    # over its 7 categories): τ per category for the trained and the untrained draft, at temperature 0 and
    # at evaluate.temperature, and the speed-up with its tokens/s (no threshold: it is what the CPU gives)
    cats, det = ev["per_category"], ev["details"]
    assert det["prompt_set"]["source"] == tiny_config.evaluate.prompts and len(cats) == 7
    assert sum(c["prompts"] for c in cats.values()) == tiny_config.evaluate.num_prompts == det["trained"]["prompts"]
    assert sum(c["drafts"] for c in cats.values()) == det["trained"]["drafts"]
    assert sum(c["accepted_tokens"] for c in cats.values()) == det["trained"]["accepted_tokens"]
    for name, c in cats.items():
        assert c["acceptance_length"] >= 1.0 and c["acceptance_length_untrained"] >= 1.0, name
        assert c["acceptance_length_sampled"] >= 1.0 and len(c["per_position_acceptance_sampled"]) == 3, name
        assert all(0.0 <= p <= 1.0 for p in c["per_position_acceptance"] + c["per_position_acceptance_sampled"])
    assert det["sampling_temperature"] == tiny_config.evaluate.temperature and det["acceptance_length_sampled"] >= 1.0
    assert ev["speedup"] > 0 and ev["speedup"] == pytest.approx(
        det["speedup_detail"]["tokens_per_s_draft"] / det["speedup_detail"]["tokens_per_s_plain"])
    assert det["speedup_detail"]["rounds"] == tiny_config.evaluate.speedup_rounds
    for k in ("tokenized", "hidden_states", "manifest", "vocab", "checkpoint", "report_md", "target_model"):
        assert rep["artifacts"][k] and Path(rep["artifacts"][k]).exists(), k
    assert (run_dir / "plots" / "acceptance.png").exists() and (run_dir / "plots" / "train_loss.png").exists()


def tiny_config_rows(rep) -> int:
    return json.loads(Path(rep["artifacts"]["manifest"]).read_text())["shards"][-1]["row_end"]


def test_corrupted_extraction_stops_before_training_and_rerun_repairs(pipeline_run, tiny_config, tmp_path):
    """The `[0]` bug in one file: verify fails the run before train; the bad file is moved aside, and
    the next extract re-does exactly its shard (from the record pool when it holds the clean record)."""
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.pipeline.stages import (
        plan_extract,
        stage_extract,
        stage_preflight,
        stage_prepare,
        stage_verify,
    )
    from eagle3_pipeline.report.runs import create_run_dir
    from flows.pipeline import pipeline

    _, rep = pipeline_run
    hs_dir = Path(rep["artifacts"]["hidden_states"])
    victim = hs_dir / "hs_5.safetensors"
    rec = load_file(str(victim))
    save_file({**rec, "hidden_states": rec["hidden_states"][0]}, str(victim))  # [T, L, H] -> [L, H]
    run_dir = create_run_dir(tmp_path, tiny_config)
    with pytest.raises(Exception, match="verify failed"):
        pipeline(config=tiny_config, run_dir=str(run_dir))
    bad = json.loads((run_dir / "report.json").read_text())
    assert bad["status"] == "failed" and "hs_5.safetensors (row 5" in bad["error"]
    assert "found [4, 128]" in bad["error"]
    assert "train" not in bad["stages"] and "evaluate" not in bad["stages"]
    ext_bad = bad["stages"]["extract"]  # every shard was published by the first run: this run did nothing
    assert ext_bad["details"]["cached"] is True and ext_bad["rows_extracted"] == 0 and ext_bad["rows_reused"] == 0
    assert ext_bad["details"]["rows_from_store"] == tiny_config_rows(rep), ext_bad
    assert not victim.exists() and (hs_dir.parent / "hidden_states_failed" / "hs_5.safetensors").exists()

    manifest = Path(rep["artifacts"]["manifest"])
    attempts_before = [s["attempts"] for s in json.loads(manifest.read_text())["shards"]]
    prep = stage_prepare(tiny_config)
    version = plan_extract(tiny_config, prep, stage_preflight(tiny_config, prep))
    assert version.manifest_path == manifest  # the flow's version, planned again from the same records
    ext = stage_extract(tiny_config, version)
    attempts_after = [s["attempts"] for s in json.loads(manifest.read_text())["shards"]]
    k = 5 // tiny_config.extract.rows_per_shard  # the shard holding row 5
    shards = json.loads(manifest.read_text())["shards"]
    diff = [a - b for a, b in zip(attempts_after, attempts_before)]
    # only that shard is redone: re-extracted by one engine child, or (the corruption wrote a new file
    # under the version's name, so the record pool still holds the clean record) linked from the pool
    # again with no engine
    assert diff in ([int(i == k) for i in range(len(diff))], [0] * len(diff)), diff
    if diff[k] == 0:
        assert shards[k]["reused_rows"] == shards[k]["row_end"] - shards[k]["row_start"], shards[k]
    assert victim.exists() and ext.shards_published == ext.shards_total
    assert stage_verify(tiny_config, version).passed


def test_each_stage_retried_once_after_an_injected_fault(pipeline_state):
    """Every stage of RETRIED failed its first attempt (the fault markers) and passed on Prefect's retry,
    inside the one flow run; the train retry resumed from the epoch before the killed one and logged
    exactly the steps of an uninterrupted run (each step once, in order; every epoch complete)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    run_dir, rep, state = pipeline_state
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    by_name = {r.name.rsplit("-", 1)[0]: r for r in runs}  # "verify-e74" -> "verify"
    for stage in RETRIED:
        tr = by_name[stage]
        assert tr.state.is_completed() and tr.run_count == 2, (stage, tr.state.name, tr.run_count)
    assert by_name["preflight"].run_count == 1  # no fault, no retry

    train = rep["stages"]["train"]
    d = train["details"]
    assert d["resumed_from_epoch"] == rep["config"]["train"]["epochs"] - 2
    rows = [json.loads(x) for x in Path(d["metrics"]).read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train_step"]
    assert [r["step"] for r in steps] == list(range(train["steps"]))
    per_epoch = [sum(r["epoch"] == e for r in steps) for e in range(d["epochs_done"])]
    assert len(set(per_epoch)) == 1 and per_epoch[0] > 0, per_epoch  # the killed epoch was replayed whole
    assert [r["epoch"] for r in rows if r["kind"] == "val"] == list(range(d["epochs_done"]))
    log = (Path(d["dir"]) / "train.log").read_text()
    assert "EAGLE3_TEST_FAIL_ONCE" in log  # the first attempt really was killed mid-epoch


def test_two_process_training_gives_a_servable_draft(pipeline_run):
    """world_size 2 (two gloo ranks under torchrun): recorded in report.json, the draft passed the
    export check and serves with τ clearly above the untrained draft's."""
    _, rep = pipeline_run
    train, ev = rep["stages"]["train"], rep["stages"]["evaluate"]
    assert train["world_size"] == 2 and train["mode"] == "offline"
    assert train["details"]["export_checked"] is True
    assert ev["acceptance_length"] > ev["acceptance_length_untrained"] + 0.5, ev
