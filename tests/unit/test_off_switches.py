"""No silent off-switch, no silent loss: a setting that turns a check off is a config error until
verify.allow_skip names the check; a skipped check and a prepare that lost more than its limits are warnings at
the top of the report and on the console, and the run ends 'completed with warnings'."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.core.config import OFF_SWITCHES, load_config, skipped_checks, switched_off
from eagle3_pipeline.core.errors import ConfigError
from eagle3_pipeline.data.tokenized import PrepareResult, loss_warnings

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = {"reference": "verify.reference_samples=0", "prediction": "verify.prediction_max_z=null",
            "identity": "verify.identity_max_z=null", "norm_bounds": "verify.norm_bounds_samples=0",
            "confirmation": "verify.confirm_rows=0", "invariance": "extract.invariance_rows=0"}


@pytest.mark.parametrize("check", SWITCHES)
def test_a_check_turned_off_without_its_name_is_a_config_error(check):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "tiny-cpu.yaml", [SWITCHES[check]])
    msg = str(err.value)
    assert f"turns the {check} check off" in msg and f"verify.allow_skip: [{check}]" in msg
    assert OFF_SWITCHES[check][1] in msg  # what the run could no longer catch
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [SWITCHES[check], f"verify.allow_skip=[{check}]"])
    assert switched_off(cfg) == [check]
    (warning,) = skipped_checks(cfg)
    assert warning.startswith(f"check {check} skipped ({OFF_SWITCHES[check][0]})") and "cannot catch" in warning


def test_every_switch_at_once_needs_every_name():
    everything = list(SWITCHES.values())
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "tiny-cpu.yaml", everything + ["verify.allow_skip=[reference]"])
    assert all(f"[{c}]" in str(err.value) for c in SWITCHES if c != "reference")
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", everything + [f"verify.allow_skip=[{', '.join(SWITCHES)}]"])
    assert len(skipped_checks(cfg)) == len(SWITCHES)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
def test_no_shipped_config_skips_a_check(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert skipped_checks(cfg) == [], name


def _prep(rows_in=1000, quarantined=0, trimmed=0, reasons=None, trims=None) -> PrepareResult:
    return PrepareResult(version="v", dir="/d", tokenized="/d/t", token_freq="/d/f", heldout="/d/h",
                         quarantine="/d/quarantine.jsonl", rows_in=rows_in, rows_out=rows_in - quarantined,
                         rows_out_sources=1, rows_heldout=0, rows_quarantined=quarantined, rows_truncated=0,
                         turns_dropped=0, rows_trimmed=trimmed, trim_reasons=trims or {}, tokens=1, supervised_tokens=1,
                         quarantine_reasons=reasons or {}, length_histogram={}, chunks_total=1, chunks_computed=1)


def test_a_prepare_that_loses_more_than_its_limits_says_so_with_numbers_and_reasons():
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml").prepare
    assert loss_warnings(_prep(quarantined=5, reasons={"empty": 5}), cfg) == []  # 0.5%: within both limits
    (w,) = loss_warnings(_prep(quarantined=100, reasons={"mask differs from a second method": 90, "empty": 10}), cfg)
    assert w.startswith("prepare lost 100 of 1000 input rows (10.0%: 100 quarantined, 0 kept with turns trimmed")
    assert "quarantined: mask differs from a second method 90 (9.0%)" in w and "/d/quarantine.jsonl" in w
    assert "empty 10" not in w  # 1.0% is not past the 1% limit: only the loud reasons are listed
    # one reason past 1% although the total is within 2%
    (w,) = loss_warnings(_prep(trimmed=15, trims={"tool call without a result": 15}), cfg)
    assert "trimmed: tool call without a result 15 (1.5%)" in w


def test_the_report_opens_with_the_warnings_and_the_status_says_so(tmp_path):
    from eagle3_pipeline.report.runs import RunDir
    from eagle3_pipeline.report.stage import write_report

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["verify.reference_samples=0", "verify.allow_skip=[reference]"])
    run = RunDir(tmp_path / "run")
    rec = run.report_record(cfg, {"prepare": _prep(quarantined=100, reasons={"empty": 100})}, {}, None)
    assert rec.status == "completed with warnings"
    assert rec.warnings[0].startswith("prepare lost 100 of 1000") and rec.warnings[1].startswith("check reference")
    write_report(tmp_path / "run", rec)
    md = (tmp_path / "run" / "report.md").read_text().splitlines()
    assert md[2] == "**Status:** completed with warnings"
    assert md[4].startswith("- ⚠ warning: prepare lost 100") and md[5].startswith("- ⚠ warning: check reference")
    clean = run.report_record(load_config(ROOT / "configs" / "tiny-cpu.yaml"), {"prepare": _prep()}, {}, None)
    assert clean.status == "completed" and clean.warnings == []
    failed = run.report_record(cfg, {}, {}, "VerifyFailed: x")
    assert failed.status == "failed" and failed.warnings  # the warnings stay on a failed run too
