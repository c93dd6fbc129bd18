"""The whole pipeline on the tiny default, through the Prefect flow, against a real (temporary)
Prefect server: real vLLM extraction and EAGLE-3 decoding, real speculators training."""

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pipeline_run(tiny_config, prefect_harness, tmp_path_factory):
    from eagle3_pipeline.runs import create_run_dir
    from flows.pipeline import pipeline

    run_dir = create_run_dir(tmp_path_factory.mktemp("runs"), tiny_config)
    pipeline(config=tiny_config, run_dir=str(run_dir))
    return run_dir, json.loads((run_dir / "report.json").read_text())


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
    for k in ("tokenized", "hidden_states", "manifest", "vocab", "checkpoint", "report_md", "target_model"):
        assert rep["artifacts"][k] and Path(rep["artifacts"][k]).exists(), k
    assert (run_dir / "plots" / "acceptance.png").exists() and (run_dir / "plots" / "train_loss.png").exists()


def test_corrupted_extraction_stops_before_training_and_rerun_repairs(pipeline_run, tiny_config, tmp_path):
    """The `[0]` bug in one file: verify fails the run before train; the bad file is moved aside, and
    the next extract re-does exactly its shard."""
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.runs import create_run_dir
    from eagle3_pipeline.stages import plan_extract, stage_extract, stage_preflight, stage_prepare, stage_verify
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
    assert not victim.exists() and (hs_dir.parent / "hidden_states_failed" / "hs_5.safetensors").exists()

    manifest = Path(rep["artifacts"]["manifest"])
    attempts_before = [s["attempts"] for s in json.loads(manifest.read_text())["shards"]]
    prep = stage_prepare(tiny_config)
    version = plan_extract(tiny_config, prep, stage_preflight(tiny_config, prep))
    assert version.manifest_path == manifest  # the flow's version, planned again from the same records
    ext = stage_extract(tiny_config, version)
    attempts_after = [s["attempts"] for s in json.loads(manifest.read_text())["shards"]]
    k = 5 // tiny_config.extract.rows_per_shard  # the shard holding row 5
    assert [a - b for a, b in zip(attempts_after, attempts_before)] == [int(i == k) for i in range(len(attempts_before))]
    assert victim.exists() and ext.shards_published == ext.shards_total
    assert stage_verify(tiny_config, version).passed
