import json

from eagle3_pipeline.report import build_report, write_report


def test_report_contract_and_plots(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "train_step", "step": 0, "epoch": 0, "loss": 9.0, "acc": [0.1, 0.0, 0.0]},
        {"kind": "train_step", "step": 1, "epoch": 0, "loss": 7.0, "acc": [0.3, 0.1, 0.0]},
        {"kind": "val", "epoch": 0, "loss": 6.5, "acc": [0.35, 0.1, 0.01]}]) + "\n")
    stages = {"prepare": {"version": "abc", "rows_in": 10, "rows_out": 8, "rows_quarantined": 1, "tokens": 99, "rows_heldout": 1},
              "evaluate": {"acceptance_length": 1.6, "acceptance_length_untrained": 1.02,
                           "per_position_acceptance": [0.5, 0.1, 0.0], "per_position_acceptance_untrained": [0.02, 0, 0]}}
    rep = build_report("r1", {"name": "x"}, {"torch": "2.13"}, stages, {"tokenized": "/t"}, "completed")
    assert rep["stages"]["prepare"]["rows_in"] == 10 and rep["stages"]["prepare"]["details"] == {"rows_heldout": 1}
    paths = write_report(tmp_path / "run", rep, metrics)
    on_disk = json.loads(open(paths["report_json"]).read())
    assert on_disk["stages"]["evaluate"]["acceptance_length"] == 1.6
    assert (tmp_path / "run/plots/train_loss.png").stat().st_size > 1000
    assert (tmp_path / "run/plots/acceptance.png").stat().st_size > 1000
    md = open(paths["report_md"]).read()
    assert "1.600 trained vs 1.020 untrained" in md and "plots/acceptance.png" in md


def test_failed_run_still_reports_the_error(tmp_path):
    rep = build_report("r2", {"name": "x"}, {}, {}, {}, "failed", "VerifyFailed: hs_3: layer 2 expected [5, 4, 128], found [4, 128]")
    paths = write_report(tmp_path / "run", rep)
    assert "found [4, 128]" in open(paths["report_md"]).read()
    assert json.loads(open(paths["report_json"]).read())["status"] == "failed"
