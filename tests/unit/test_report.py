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


def test_timings_contract_and_table(tmp_path):
    """report.json `timings` ({stage: {seconds, engine_start_s}}, DESIGN §2) from a StageClock, and the
    table in report.md; the stage records say how much of a stage was engine start-up."""
    import types

    import pytest

    from eagle3_pipeline.runs import StageClock

    clock = StageClock()
    assert clock("vocab", lambda a, b=0: a + b, 1, b=2) == 3
    clock("gpu-gate", lambda: None)
    clock("gpu-gate", lambda: None)  # a stage timed twice adds up
    with pytest.raises(ValueError):
        clock("evaluate", _raise)  # a failing stage is timed too
    clock.seconds["train"] = 40.0
    recs = {"train": types.SimpleNamespace(engine_start_s=12.5), "vocab": types.SimpleNamespace()}
    timings = clock.timings(recs)
    assert list(timings) == ["vocab", "gpu-gate", "evaluate", "train"]
    assert all(set(t) == {"seconds", "engine_start_s"} for t in timings.values())
    assert timings["train"] == {"seconds": 40.0, "engine_start_s": 12.5}
    assert timings["vocab"]["engine_start_s"] is None and timings["evaluate"]["engine_start_s"] is None
    rep = build_report("r3", {"name": "x"}, {}, {}, {}, "completed", timings=timings)
    assert rep["timings"] is timings
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    assert "| stage | seconds | engine start s | work s |" in md
    assert "| train | 40.0 | 12.5 | 27.5 |" in md
    assert build_report("r4", {}, {}, {}, {}, "completed")["timings"] == {}  # the key is always there


def _raise():
    raise ValueError("stage failed")


def test_extract_engine_start_counts_this_runs_children(tmp_path):
    from eagle3_pipeline.extract.shards import engine_start_since
    from eagle3_pipeline.store import write_json

    write_json(tmp_path / "manifest.json", {"shards": [], "children": [
        {"attempt": 1, "started_at": "2020-01-01T00:00:00Z", "engine_start_s": 30.0},  # an earlier run
        {"attempt": 2, "started_at": "2030-01-01T00:00:05Z", "engine_start_s": 20.5},
        {"attempt": 3, "started_at": "2030-01-01T00:01:00Z", "engine_start_s": 1.25},
        {"attempt": 4, "started_at": "2030-01-01T00:02:00Z", "engine_start_s": None}]})  # died before ready
    assert engine_start_since(tmp_path, 1893456005.0) == 21.75  # 2030-01-01T00:00:05Z
    assert engine_start_since(tmp_path, 1893456300.0) is None
