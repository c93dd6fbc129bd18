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
