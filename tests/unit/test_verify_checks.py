"""verify's checks as small objects (verify/check.py) and its record nested by check (records/verification.py)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.core.config import VerifyConfig
from eagle3_pipeline.records.verification import FLAT, CheckResult, VerifyChecks, VerifyResult
from eagle3_pipeline.verify.check import Check, RecordCheck, merge
from eagle3_pipeline.verify.invariance import Invariance


class Odd(RecordCheck):
    """A toy check: judges the numbers under 10 and flags the odd ones."""
    name = "odd"

    def admits(self, x: int) -> bool:
        return x < 10

    def unable(self, items) -> str | None:
        return None if items else "nothing under 10"

    def row_of(self, x: int) -> int:
        return x

    def problems_of(self, x: int) -> list[str]:
        return [f"{x} is odd"] if x % 2 else []


def test_the_base_counts_times_and_fills_the_result():
    out = Odd().run([1, 2, 3, 4, 12, 13])
    assert out.result == CheckResult(ran=True, records=4, flagged=2, seconds=out.result.seconds)
    assert out.result.seconds is not None and out.result.seconds >= 0
    assert out.flags == {1: ["1 is odd"], 3: ["3 is odd"]}
    skipped = Odd().run([12, 13])
    assert not skipped.result.ran and skipped.result.records == 0 and skipped.result.skipped == "nothing under 10"
    assert skipped.flags == {}


def test_a_check_without_a_verdict_cannot_be_made():
    class NoVerdict(Check):
        name = "none"

    with pytest.raises(TypeError, match="verdict"):
        NoVerdict()


def test_merge_adds_each_problem_once_and_no_row_without_one():
    problems = {1: ["a"]}
    merge(problems, {1: ["a", "b"], 2: [], 3: ["c"]})
    assert problems == {1: ["a", "b"], 3: ["c"]}  # row 2: flagged, its problem said by the scan that measured it


def _entry(rel_err: float, cosine: float = 0.9999, frac: float = 0.0, shift: int | None = None) -> dict:
    e = {"layers": [{"layer_id": 3, "rel_err": rel_err, "mean_cosine": cosine, "frac_below": frac}]}
    if shift is not None:
        e["shifts"] = {"3": shift}
    return e


def test_invariance_flags_the_rows_past_its_limits_from_config():
    cfg = VerifyConfig()
    entries = [(0, _entry(0.001)), (5, _entry(cfg.invariance_max_rel_err * 2, shift=1)), (7, {"error": "shape"})]
    out = Invariance(cfg, "bf16", {5: "hs_5"}).run(entries)
    assert out.result.ran and out.result.records == 3 and out.result.flagged == 2
    assert out.result.samples == [0, 5, 7] and out.result.max_rel_err == cfg.invariance_max_rel_err * 2
    assert "hs_5: layer 3" in out.flags[5][0] and "shifted by +1 token" in out.flags[5][0]
    assert "differ in shape" in out.flags[7][0] and 0 not in out.flags
    # fp8 records: the same error is within the looser limit
    assert Invariance(cfg, "fp8", {}).run(entries[:2]).result.flagged == 0
    none = Invariance(cfg, "bf16", {}, "extract.invariance_rows is 0").run([])
    assert not none.result.ran and none.result.skipped == "extract.invariance_rows is 0"


def test_verify_result_nests_by_check_and_keeps_every_flat_key():
    checks = VerifyChecks()
    checks.reference.max_rel_err, checks.reference.samples, checks.reference.peak_rss_bytes = 0.01, [3, 9], 123
    checks.identity.profile, checks.structure.records, checks.state_sketch.flagged = {"max_z": 8.0}, 40, 1
    res = VerifyResult(content_key="k", passed=False, problems=["p"], bad_rows=[2], checks=checks)
    dumped = res.model_dump(mode="json")
    assert set(FLAT) <= set(dumped)  # the keys verify.json and report.json had before the nesting
    assert dumped["reference_samples"] == [3, 9] and dumped["identity_profile"] == {"max_z": 8.0}
    assert dumped["sketch_failed"] == 1 and dumped["fingerprint"]["rows_checked"] == 0
    assert (dumped["samples_checked"], dumped["reference_max_rel_err"], dumped["reference_peak_rss_bytes"]) == \
        (40, 0.01, 123)  # report.json's contract keys, from the checks
    again = VerifyResult.model_validate(dumped)
    assert again.checks == res.checks and again.samples_checked == 40
    assert res.checks["identity"] is res.checks.identity and [k for k, _ in res.checks.items()][-1] == "masks"
    with pytest.raises(KeyError):
        res.checks["nope"]


def test_a_verify_json_of_the_flat_format_still_loads():
    """verify.json written before the nesting: require_verified reads passed, content_key and shard_hashes."""
    old = {"content_key": "k", "passed": True, "samples_checked": 4, "tokens_checked": 40, "problems": [],
           "bad_rows": [], "moved_files": [], "layer_stats": [], "reference_max_rel_err": 0.02,
           "reference_min_cosine": 0.99, "reference_samples": [1], "reference_skipped": None,
           "shard_hashes": {"0": "h"}, "checks": {"structure": {"ran": True, "records": 4, "skipped": None}}}
    res = VerifyResult.model_validate(old)
    assert res.passed and res.shard_hashes == {"0": "h"} and res.checks.structure.records == 4
