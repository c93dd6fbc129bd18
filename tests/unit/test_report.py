import json

from eagle3_pipeline.report.record import RunReport
from eagle3_pipeline.report.stage import build_report as _build_report
from eagle3_pipeline.report.stage import write_report as _write_report


def build_report(*args, **kw) -> dict:
    """report.build_report's RunReport as report.json holds it (these tests index it as a reader does)."""
    return _build_report(*args, **kw).to_json()


def write_report(run_dir, rep: dict, metrics=None) -> dict:
    """report.write_report of a report as report.json holds it (the samples are JSON): validated on the way."""
    return _write_report(run_dir, RunReport.model_validate(rep), metrics)


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
    assert "**1.600** trained vs 1.020 untrained" in md
    # the plots are embedded (report.md is also the Prefect UI artifact, where a relative link is broken)
    assert "![acceptance rate per draft position][acceptance]" in md
    assert "[acceptance]: data:image/png;base64," in md and "](plots/" not in md


def test_failed_run_still_reports_the_error(tmp_path):
    rep = build_report("r2", {"name": "x"}, {}, {}, {}, "failed", "VerifyFailed: hs_3: layer 2 expected [5, 4, 128], found [4, 128]")
    paths = write_report(tmp_path / "run", rep)
    assert "found [4, 128]" in open(paths["report_md"]).read()
    assert json.loads(open(paths["report_json"]).read())["status"] == "failed"


def test_timings_contract_and_table(tmp_path):
    """report.json `timings` ({stage: {seconds, engine_start_s}}, docs/operations.md "Reading a run") from a StageClock, and the
    table in report.md; the stage records say how much of a stage was engine start-up."""
    import types

    import pytest

    from eagle3_pipeline.report.runs import StageClock

    clock = StageClock()
    with clock.stage("vocab"):
        pass
    for _ in range(2):  # a stage timed twice adds up
        with clock.stage("gpu-gate"):
            pass
    with pytest.raises(ValueError), clock.stage("evaluate"):
        _raise()  # a failing stage is timed too
    clock.seconds["train"] = 40.0
    recs = {"train": types.SimpleNamespace(engine_start_s=12.5), "vocab": types.SimpleNamespace()}
    timings = clock.timings(recs)
    assert list(timings) == ["vocab", "gpu-gate", "evaluate", "train"]
    assert all(set(t) == {"seconds", "engine_start_s"} for t in timings.values())
    assert timings["train"] == {"seconds": 40.0, "engine_start_s": 12.5}
    assert timings["vocab"]["engine_start_s"] is None and timings["evaluate"]["engine_start_s"] is None
    rep = build_report("r3", {"name": "x"}, {}, {}, {}, "completed", timings=timings)
    assert rep["timings"] == timings
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    assert "| stage | seconds | engine start s | work s |" in md
    assert "| train | 40.0 | 12.5 | 27.5 |" in md
    assert build_report("r4", {}, {}, {}, {}, "completed")["timings"] == {}  # the key is always there


def _raise():
    raise ValueError("stage failed")


def test_extract_engine_start_counts_this_runs_children(tmp_path):
    from eagle3_pipeline.core.store import write_json
    from eagle3_pipeline.records.shardrun import engine_start_since

    write_json(tmp_path / "manifest.json", {"shards": [], "children": [
        {"attempt": 1, "started_at": "2020-01-01T00:00:00Z", "engine_start_s": 30.0},  # an earlier run
        {"attempt": 2, "started_at": "2030-01-01T00:00:05Z", "engine_start_s": 20.5},
        {"attempt": 3, "started_at": "2030-01-01T00:01:00Z", "engine_start_s": 1.25},
        {"attempt": 4, "started_at": "2030-01-01T00:02:00Z", "engine_start_s": None}]})  # died before ready
    assert engine_start_since(tmp_path, 1893456005.0) == 21.75  # 2030-01-01T00:00:05Z
    assert engine_start_since(tmp_path, 1893456300.0) is None


# ------------------------------------------------------------------ report.md as a reader sees it (issue 17)

def _rendered(md: str) -> tuple[str, list[str], dict[str, bytes]]:
    """(the text a reader reads: no code spans, no embedded images; the table lines; the embedded PNGs)."""
    import base64
    import re

    images = {m[1]: base64.b64decode(m[2]) for m in re.finditer(r"^\[(\w+)\]: data:image/png;base64,(\S+)$", md, re.M)}
    body = "\n".join(line for line in md.splitlines() if not line.startswith("[") or "]: data:" not in line)
    text = re.sub(r"`[^`]*`", "", body)
    return text, [line for line in body.splitlines() if line.startswith("|")], images


def test_report_md_rounds_numbers_and_keeps_tables_small(tmp_path):
    """The sample report (full-precision floats, long paths, 7 categories, every new key of issue 17):
    no number over 6 significant digits, no table line over 110 characters or table over 16 rows (the
    Prefect UI neither wraps cells nor shows more than a screen of a table), the plots embedded as
    PNGs identical to plots/*.png, the new numbers in the summary."""
    import io

    from PIL import Image

    from tests.helpers.report_sample import long_numbers, sample_metrics, sample_report

    run = tmp_path / "run"
    paths = write_report(run, sample_report(), sample_metrics(tmp_path / "metrics.jsonl"))
    md = open(paths["report_md"]).read()
    text, table_lines, images = _rendered(md)
    assert long_numbers([text]) == []
    assert "0.2856296896934509" in open(paths["report_json"]).read()  # report.json keeps full precision
    assert max(len(line) for line in table_lines) <= 110, max(table_lines, key=len)
    tables = [t for t in "\n".join(line if line.startswith("|") else "" for line in md.splitlines()).split("\n\n") if t.strip()]
    assert len(tables) >= 9 and max(t.strip().count("\n") + 1 for t in tables) <= 17, tables
    assert set(images) == {"train_loss", "acceptance", "tau_per_category"}
    for name, data in images.items():
        assert data == (run / "plots" / f"{name}.png").read_bytes()
        w, h = Image.open(io.BytesIO(data)).size
        assert 300 <= w <= 800 and 200 <= h <= 400, (name, w, h)
    assert len(md.encode()) < 100_000, len(md.encode())
    # the summary: τ, τ sampled (prompt-weighted over the categories), speed-up, train mode, regenerate
    assert "**2.175** trained vs 1.003 untrained" in md
    assert "**τ at temperature 0.7** (trained): 1.813" in md
    assert "**0.62×** (143.4 vs 230 output tokens/s, 3 rounds)" in md
    assert ("**Training:** online, 128 steps, final loss 0.2856 (the last step's), held-out loss 0.3123, hidden states "
            "on disk at peak 2.1 MB, every row from the server judged (structure, fingerprint, identity): 2 flagged and "
            "cleared by the target, 1 not delivered") in md
    assert ("300 rows in, 297 rows out, 3 rows quarantined, 48,213 tokens generated (version `0c1d2e3f4a5b`); "
            "⚠ **37 of 412 answers cut short** and kept (at max_tokens 256: 37); ⚠ **21 of 412 answers repeat "
            "themselves** (fewer than half of their 8-token spans distinct; kept: the draft learns the loops)") in md
    assert ("- **Training data:** 349 rows, 63,077 tokens, 30,412 of them trained on (the loss mask); "
            "6 rows cut at prepare.max_length") in md
    # τ per category: one row per category, the sampled column with a dash where it was not measured
    assert "| category | prompts | τ trained | τ untrained | τ at T=0.7 | accepted per position |" in md
    assert "| arithmetic | 12 | 2.417 | 1.003 | 2.012 | 0.64 / 0.43 / 0.35 |" in md
    assert "| multi-turn | 8 | 2.182 | 1.000 | – | 0.55 / 0.36 / 0.27 |" in md
    assert "![acceptance length per prompt category][tau_per_category]" in md
    # one table per stage; bytes in units, paths in the artifact list only
    assert "| extract | |" in md and "| bytes on disk | 65.2 MB |" in md and "| reference peak rss bytes | 1.83 GB |" in md
    assert "| layer ids | [2, 5, 9, 13, 17, 20, … 10 in all] |" in md and "| passed | yes |" in md
    assert "- **checkpoint**: `/srv/eagle3/store/" in md


def test_report_md_without_the_new_keys(tmp_path):
    """Every key the report shows is optional: a run without regenerate, train mode, per-category or
    speed-up numbers (and one with malformed ones) renders the rest and nothing for them."""
    from tests.helpers.report_sample import sample_report

    rep = sample_report()
    del rep["stages"]["regenerate"]
    for k in ("per_category", "speedup"):
        del rep["stages"]["evaluate"][k]
    rep["stages"]["evaluate"]["details"] = {}
    rep["stages"]["train"].update(mode=None, details={})
    md = open(write_report(tmp_path / "a", rep)["report_md"]).read()
    assert "**2.175** trained vs 1.003 untrained" in md
    for absent in ("Speed-up", "temperature 0.7", "Training:", "Regenerated", "per prompt category", "tau_per_category"):
        assert absent not in md, absent
    assert not (tmp_path / "a/plots/tau_per_category.png").exists()
    assert "| acceptance length | 2.175 |" in md

    # malformed / partial values: never a crash, never a warning about plots
    rep = sample_report()
    ev = rep["stages"]["evaluate"]
    ev.update(speedup=None, per_category={"default": {"prompts": 3, "acceptance_length": 1.5},
                                          "empty": {}, "nan": {"acceptance_length": float("nan")}})
    ev["details"] = {"speedup_detail": {"rounds": 2}}
    rep["stages"]["train"]["details"] = {"hidden_states_peak_bytes": None}
    rep["stages"]["regenerate"] = {"version": None, "rows_in": None, "details": {}}
    paths = write_report(tmp_path / "b", rep)
    md = open(paths["report_md"]).read()
    assert json.loads(open(paths["report_json"]).read())["warnings"] == []
    assert "Speed-up" not in md and "hidden states on disk" not in md
    assert "| category | prompts | τ trained |\n" in md  # only the columns some category has
    assert "| default | 3 | 1.500 |" in md and "| empty | – | – |" in md and "| nan | – | – |" in md  # NaN is null in report.json (valid JSON)
    # a category that is not a record is refused where the report is built, before anything is written
    import pytest
    from pydantic import ValidationError

    ev["per_category"]["odd"] = "not a dict"
    with pytest.raises(ValidationError, match="per_category.odd"):
        write_report(tmp_path / "odd", rep)
    del ev["per_category"]["odd"]

    # long category names and many draft positions stay narrow
    ev["per_category"] = {"a-category-name-far-longer-than-a-table-cell-should-be": {
        "prompts": 1, "acceptance_length": 2.0, "per_position_acceptance": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]}}
    md = open(write_report(tmp_path / "c", rep)["report_md"]).read()
    assert "| a-category-name-far-lon… | 1 | 2.000 | 0.90 / 0.80 / 0.70 / 0.60 / 0.50 / … |" in md
    assert "[tau_per_category]: data:image/png;base64," in md


def test_new_keys_render_from_stage_records_through_build_report(tmp_path):
    """The stages' flat records through build_report: a number still outside CONTRACT sits in details
    and is shown all the same (report.md reads a key from the record or its details)."""
    from tests.helpers.report_sample import sample_report

    sample = sample_report()["stages"]
    flat = {name: {**{k: v for k, v in st.items() if k != "details"}, **st.get("details", {})}
            for name, st in sample.items()}
    rep = build_report("r5", {"name": "x"}, {}, flat, {}, "completed")
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    assert "**0.62×**" in md and "| arithmetic | 12 | 2.417 |" in md and "**Training:** online" in md
    assert "hidden states on disk at peak 2.1 MB" in md
    if "regenerate" in rep["stages"]:
        assert "48,213 tokens generated" in md


def test_a_failing_plot_is_a_warning_and_the_others_stay(tmp_path, monkeypatch):
    from eagle3_pipeline.report import stage as report_stage
    from tests.helpers.report_sample import sample_metrics, sample_report

    def broken(plt, run_dir, ev):
        raise ValueError("could not draw")

    monkeypatch.setattr(report_stage, "_acceptance_plot", broken)
    rep = sample_report()
    paths = write_report(tmp_path / "run", rep, sample_metrics(tmp_path / "m.jsonl"))
    md = open(paths["report_md"]).read()
    warnings = json.loads(open(paths["report_json"]).read())["warnings"]
    assert [w.split(":")[0] for w in warnings] == ["plot acceptance failed"], warnings
    assert "[train_loss]: data:image/png" in md and "[tau_per_category]: data:image/png" in md
    assert "[acceptance]" not in md and not (tmp_path / "run/plots/acceptance.png").exists()
    assert "- ⚠ warning: plot acceptance failed: " in md


def test_a_sampled_tau_the_build_cannot_measure_is_flagged(tmp_path):
    """evaluate's sampling_warning (vLLM's CPU build samples wrong tokens with a draft at T > 0) stands next
    to the sampled τ in the summary, so nobody reads 1.0 at T=0.7 as the draft's quality."""
    from tests.helpers.report_sample import sample_report

    rep = sample_report()
    rep["stages"]["evaluate"]["details"]["sampling_warning"] = "vLLM's CPU build emits wrong tokens at T > 0"
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    assert ("**τ at temperature 0.7** (trained): 1.813 — ⚠ not a measure of the draft here: vLLM's CPU build "
            "emits wrong tokens at T > 0") in md
    plain = open(write_report(tmp_path / "run2", sample_report())["report_md"]).read()
    assert "not a measure of the draft" not in plain


# ------------------------------------------------------------------ the n-gram baseline beside τ

def _ngram_sample() -> dict:
    """The sample report with evaluate's n-gram baseline (EvaluateReport.baseline_ngram, as the stage returns it)."""
    from tests.helpers.report_sample import CATEGORIES, sample_report

    rep = sample_report()
    per_cat = {name: {"prompts": n, "tokens_per_step": 1.0 + 0.05 * i + 1 / 3, "steps": 100 + i, "proposed_steps": 20 + i,
                      "accepted_tokens": 30, "generated_tokens": 140, "draft_tokens": 60,
                      "acceptance_length_proposed": 2.4166666666666665, "output_tokens_per_step": 1.2,
                      "tokens_past_end": 3} for i, (name, (n, *_)) in enumerate(CATEGORIES.items())}
    ev = rep["stages"]["evaluate"]
    ev["baseline_ngram"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                            "tokens_per_step": 1.3125, "steps": 748, "proposed_steps": 161, "draft_tokens": 483,
                            "accepted_tokens": 234, "generated_tokens": 1030, "acceptance_length_proposed": 2.453416149068323,
                            "output_tokens_per_step": 1.2379679144385027, "tokens_past_end": 56, "per_category": per_cat,
                            "engine_start_s": 2.5123456, "generate_s": 0.912345, "run_s": 6.2512345, "speedup": 1.0712345,
                            "tokens_per_s": 240.123456, "lossless_checked": 80, "lossless_mismatches": 0,
                            "lossless_reference": "untrained"}
    for name, c in ev["per_category"].items():
        c["tokens_per_step_ngram"] = per_cat[name]["tokens_per_step"]
    ev["details"]["trained"] = {"output_tokens_per_step": 1.8712345}  # EvalResult of the trained draft
    return rep


def test_ngram_baseline_in_report_json_md_and_timings(tmp_path):
    """stages.evaluate.baseline_ngram is a contract key (new; nothing renamed), report.md shows it beside τ
    in the summary and per category, and its cost is part of timings.evaluate (and a row of the Time table
    that the total does not count twice)."""
    sample = _ngram_sample()
    flat = {name: {**{k: v for k, v in st.items() if k != "details"}, **st.get("details", {})}
            for name, st in sample["stages"].items()}
    timings = sample["timings"]
    rep = build_report("r6", {"name": "x"}, {}, flat, {}, "completed", timings=timings)
    ev = rep["stages"]["evaluate"]
    assert ev["baseline_ngram"]["tokens_per_step"] == 1.3125 and "baseline_ngram" not in ev["details"]
    assert {"acceptance_length", "acceptance_length_untrained", "per_position_acceptance", "per_category",
            "speedup"} <= set(ev)  # the old keys stay where they were
    assert rep["timings"]["evaluate"] == {"seconds": 123.8123, "engine_start_s": 24.2123, "baseline_ngram_s": 6.25,
                                          "baseline_ngram_engine_start_s": 2.51}
    assert "baseline_ngram_s" not in timings["evaluate"]  # the caller's record is not changed
    paths = write_report(tmp_path / "run", rep)
    assert json.loads(open(paths["report_json"]).read())["stages"]["evaluate"]["baseline_ngram"]["steps"] == 748
    md = open(paths["report_md"]).read()
    assert ("- **n-gram baseline** (vLLM prompt lookup, no draft, k=3, n 2–4): **1.312** tokens per target step vs "
            "τ 2.175 trained (over all 748 decode steps; it proposed on 161, vLLM's mean acceptance length over those "
            "2.453); tokens that reached the answers per step 1.238 vs 1.871 trained; speed-up 1.07×; cost 6.3 s "
            "(engine start 2.5 s)") in md
    assert "| category | prompts | τ trained | τ untrained | τ at T=0.7 | n-gram tok/step | accepted per position |" in md
    assert "| arithmetic | 12 | 2.417 | 1.003 | 2.012 | 1.333 | 0.64 / 0.43 / 0.35 |" in md
    assert "| evaluate | 123.8 | 24.2 | 99.6 |\n| ↳ of which n-gram baseline | 6.2 | 2.5 | 3.7 |" in md
    assert "| **total** | **255.8** | **60.8** | **194.9** |" in md  # the baseline row is not added again
    text, table_lines, _ = _rendered(md)
    from tests.helpers.report_sample import long_numbers

    assert long_numbers([text]) == [] and max(len(line) for line in table_lines) <= 110
    assert rep["warnings"] == []


def test_report_without_ngram_baseline_has_no_trace_of_it(tmp_path):
    from tests.helpers.report_sample import sample_report

    rep = sample_report()
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    assert "n-gram" not in md
    rep = build_report("r7", {}, {}, {"evaluate": {"acceptance_length": 1.5, "baseline_ngram": None}}, {}, "completed",
                       timings={"evaluate": {"seconds": 10.0, "engine_start_s": 4.0}})
    assert rep["timings"]["evaluate"] == {"seconds": 10.0, "engine_start_s": 4.0}
    assert rep["stages"]["evaluate"]["baseline_ngram"] is None
    # malformed: refused where the report is built (the entry is typed by the stage's model), before anything is
    # written; a partial baseline (a failed stage's) is no crash either
    import pytest
    from pydantic import ValidationError

    rep["stages"]["evaluate"]["baseline_ngram"] = {"tokens_per_step": "x", "per_category": 3}
    with pytest.raises(ValidationError, match="baseline_ngram"):
        write_report(tmp_path / "b", rep)
    assert not (tmp_path / "b" / "report.json").exists()
    rep["stages"]["evaluate"]["baseline_ngram"] = {"per_category": {}}
    assert "n-gram" not in open(write_report(tmp_path / "c", rep)["report_md"]).read()


def test_cli_status_and_last_line_print_rounded_numbers(tmp_path):
    """`eagle3 status` and the last line of `eagle3 run`: τ at 2 decimals with the n-gram baseline beside
    it (not `τ = 2.479495268138801`), every stage's floats rounded, dicts as their size."""
    from typer.testing import CliRunner

    from flows.cli import app, evaluate_headline

    sample = _ngram_sample()
    sample["stages"]["evaluate"]["acceptance_length"] = 2.479495268138801
    run = tmp_path / "runs" / sample["run_id"]
    paths = write_report(run, sample)
    (tmp_path / "runs" / "latest").symlink_to(run.name)
    assert evaluate_headline(sample["stages"]["evaluate"]) == \
        "τ 2.48 (untrained 1.00), n-gram 1.31 tokens/step, speed-up 0.62x"
    res = CliRunner().invoke(app, ["status", "--output-dir", str(tmp_path / "runs")], env={"COLUMNS": "500"})
    assert res.exit_code == 0, res.stdout
    out = res.stdout
    assert f"run {sample['run_id']}: completed — τ 2.48 (untrained 1.00), n-gram 1.31 tokens/step, speed-up 0.62x" in out
    assert "acceptance_length=2.48," in out and "tokens_per_s=3,237" in out and "reference_max_rel_err=0.0128" in out
    assert "acceptance_length=2.48," in out and "per_position_acceptance=[0.536, 0.385, 0.253]" in out
    assert "per_category={7 entries}" in out and "tokens_per_s=4,752" in out
    assert "2.4794" not in out and "0.2856296" not in out
    assert json.loads(open(paths["report_json"]).read())["stages"]["evaluate"]["acceptance_length"] == 2.479495268138801


def test_verify_line_names_every_check_and_its_clean_margin(tmp_path):
    """report.md's verify line: which checks ran on how many records, which were skipped and why, and each
    learned check's clean margin against its limit."""
    checks = {"structure": {"ran": True, "records": 40}, "fingerprint": {"ran": True, "records": 40, "clean_margin": 0.4213},
              "identity": {"ran": True, "records": 40, "max_deviation": 6.04, "profile": {"max_z": 20.0}},
              "norm_bounds": {"ran": True, "records": 40, "margin": 0.49},
              "reference": {"ran": False, "records": 0, "skipped": "not local"}}
    verify = {"passed": True, "samples_checked": 40, "checks": checks, "reference_max_rel_err": None}
    rep = build_report("r6", {"name": "x"}, {}, {"verify": verify}, {}, "completed")
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    line = next(ln for ln in md.splitlines() if ln.startswith("- **Verify** passed"))
    assert "fingerprint (40 records; largest error 0.421 of the tolerance)" in line, line
    assert "identity (40 records; largest deviation 6.04 of 20)" in line, line
    assert "norm_bounds (40 records; largest deviation 0.49 of the bound)" in line, line
    assert "skipped: reference (not local)" in line, line


def test_evaluate_cost_per_number_in_report_md(tmp_path):
    rep = build_report("r7", {"name": "x"}, {}, {"evaluate": {"acceptance_length": 1.35,
                                                            "engine_run_s": {"trained": 90.5, "untrained": 91.2, "ngram": 56.1}}},
                       {}, "completed")
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    assert "**What each number cost** (seconds of each engine's whole run): trained 90.5 s, untrained 91.2 s, ngram 56.1 s" in md


# ------------------------------------------------------------------ report.json's keys: added, never renamed

KEYS_FILE = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "report_keys.json"


def _key_paths(model, prefix: str = "") -> set[str]:
    """Every key path of a pydantic model as report.json spells it (`stages.verify.passed`), into nested models."""
    import typing

    from pydantic import BaseModel

    out = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.add(path)
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out |= _key_paths(arg, f"{path}.")
    return out


def test_report_json_keys_are_only_ever_added():
    """tests/data/report_keys.json holds every key report.json has had since it was typed: a key of that list
    missing from RunReport is a renamed or dropped key (a reader's script breaks); a new key is added to the list
    in the same change, so that it is kept from then on."""
    kept = set(json.loads(KEYS_FILE.read_text()))
    now = _key_paths(RunReport)
    assert kept - now == set(), f"report.json keys renamed or removed (keys are only added): {sorted(kept - now)}"
    assert now - kept == set(), f"new report.json keys: add them to {KEYS_FILE.name}: {sorted(now - kept)}"
    # and the checker sees a rename
    from pydantic import create_model

    renamed = create_model("Renamed", run=(str, ...), status=(str, ...))
    assert "run_id" not in _key_paths(renamed) and "run" in _key_paths(renamed)


def test_each_baseline_states_its_share_of_evaluate(tmp_path):
    """timings.evaluate carries what the suffix decoding baseline's engine cost beside the n-gram one's, and the
    Time table shows both inside evaluate's row (not added to the total again)."""
    sample = _ngram_sample()
    ev = sample["stages"]["evaluate"]
    ev["baseline_suffix"] = {**ev["baseline_ngram"], "method": "suffix", "tokens_per_step": 1.5, "run_s": 4.04,
                             "engine_start_s": 1.91}
    flat = {name: {**{k: v for k, v in st.items() if k != "details"}, **st.get("details", {})}
            for name, st in sample["stages"].items()}
    rep = build_report("r7", {"name": "x"}, {}, flat, {}, "completed", timings=sample["timings"])
    t = rep["timings"]["evaluate"]
    assert (t["baseline_suffix_s"], t["baseline_suffix_engine_start_s"], t["baseline_ngram_s"]) == (4.04, 1.91, 6.25)
    md = open(write_report(tmp_path / "run", rep)["report_md"]).read()
    assert "| ↳ of which suffix decoding baseline | 4.0 | 1.9 | 2.1 |" in md
    assert "| ↳ of which n-gram baseline | 6.2 | 2.5 | 3.7 |" in md
    assert "| **total** | **255.8** |" in md
    assert "**suffix decoding baseline** (vLLM `method: suffix`, no draft, k=3" in md


def test_a_stage_entry_is_made_from_the_stage_record():
    """An entry's contract keys take their types from the stage's own result model (one declaration): a key the
    model lacks fails at import, and a value of the wrong type fails as the stage's model would fail it."""
    import pytest
    from pydantic import ValidationError

    from eagle3_pipeline.extract.stage import ExtractResult
    from eagle3_pipeline.report.record import ExtractEntry, TrainEntry, entry_of
    from eagle3_pipeline.train.stage import TrainResult

    assert TrainEntry.model_fields["steps"].annotation == (TrainResult.model_fields["steps"].annotation | None)
    assert ExtractEntry.model_fields["layer_ids"].annotation == (list[int] | None) == \
        (ExtractResult.model_fields["layer_ids"].annotation | None)
    with pytest.raises(TypeError, match=r"TrainResult has no field\(s\) \['stepz'\]"):
        entry_of(TrainResult, "steps", "stepz")
    with pytest.raises(ValidationError):
        TrainEntry(steps="many")
    assert TrainEntry(steps=3, details={"tokens": 9}).value("tokens") == 9 and TrainEntry().value("steps") is None
