"""The run report: `report.json` (a stable contract: docs/operations.md, "Reading a run"), `report.md` and PNG plots.

Builds one typed `RunReport` from the records each stage returned and renders report.md from it (attribute
access, no dicts); reads `metrics.jsonl` of training. Writes into the
run directory: report.json, report.md, plots/train_loss.png, plots/acceptance.png,
plots/tau_per_category.png. report.md is self-contained (the plots embedded as data URIs): it is also
the Prefect UI's `report-<config>` artifact. Always written, also when a stage failed: missing stages
appear as absent with the error text; every key report.md shows is optional.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.stage_spec import IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import atomic_write, atomic_write_text, write_json
from eagle3_pipeline.report.decision import NOT_RECORDED, CurvePoint, Decision, decide
from eagle3_pipeline.report.record import (
    Artifacts,
    EvaluateEntry,
    RunReport,
    StageEntry,
    Stages,
    StageTiming,
    VerifyEntry,
)

# the reported stages in run order: Stages' fields (pipeline/registry.py REPORTED; tests/unit/test_architecture.py checks the two)
STAGES = tuple(Stages.model_fields)
# report.json fields per stage (the contract: the entry models of record.py); other keys a stage returns are
# kept under "details"
CONTRACT = {name: tuple(k for k in field.annotation.__args__[0].model_fields if k != "details")
            for name, field in Stages.model_fields.items()}


def build_report(run_id: str, config: dict, versions: dict, stages: dict[str, dict], artifacts: dict[str, str],
                 status: str, error: str | None = None, timings: dict[str, dict] | None = None,
                 curve: list[CurvePoint] | None = None) -> RunReport:
    """report.json's record; `timings` is {stage: {"seconds", "engine_start_s"}} (runs.StageClock). The
    evaluate stage's n-gram baseline costs one more engine: its seconds (`run_s`, inside evaluate's) are
    added to timings.evaluate as `baseline_ngram_s` (and its engine start as `baseline_ngram_engine_start_s`)."""
    timings = _with_baseline_cost(timings or {}, stages.get("evaluate"))
    out_stages: dict[str, Any] = {}
    for name in STAGES:
        rec = stages.get(name)
        if rec is None:
            continue
        keys = CONTRACT.get(name, ())
        entry = {k: rec.get(k) for k in keys}
        entry["details"] = {k: v for k, v in rec.items() if k not in keys}
        out_stages[name] = entry
    rep = RunReport(run_id=run_id, status=status, error=error, config=config, versions=versions, timings=timings,
                    stages=Stages.model_validate(out_stages), artifacts=Artifacts.model_validate(artifacts))
    rep.decision = decide(rep.to_json()["stages"].get("evaluate"), curve or [])
    return rep


def _with_baseline_cost(timings: dict[str, dict], evaluate: dict | None) -> dict[str, dict]:
    """timings.evaluate with what each training-free baseline's engine cost inside it (baseline_<name>_s)."""
    out = dict(timings)
    for name in ("ngram", "suffix"):
        base = evaluate.get(f"baseline_{name}") if isinstance(evaluate, dict) else None
        if "evaluate" not in out or not isinstance(base, dict) or not _isnum(base.get("run_s")):
            continue
        out["evaluate"] = {**out["evaluate"], f"baseline_{name}_s": round(base["run_s"], 2),
                           f"baseline_{name}_engine_start_s": round(base["engine_start_s"], 2)
                           if _isnum(base.get("engine_start_s")) else None}
    return out


# ------------------------------------------------------------------------------------------- plots
# Plots are PNG files in plots/ *and* embedded in report.md as data URIs (reference-style links at the
# end of the file, so the text stays readable): the same report.md is the Prefect UI artifact, where a
# relative link is a broken image, and a file a user opens from the run dir. 80 dpi palette PNGs keep
# the embedded copies at tens of KiB each.
PLOT_DPI = 80


@dataclass(frozen=True)
class Plot:
    name: str   # file stem and the reference label in report.md
    title: str  # alt text
    path: str   # relative to the run dir

    def data_uri(self, run_dir: Path) -> str:
        return "data:image/png;base64," + base64.b64encode((run_dir / self.path).read_bytes()).decode("ascii")


def _save(fig, run_dir: Path, name: str, title: str) -> Plot:
    """The figure as a 64-colour palette PNG (a few times smaller than matplotlib's RGBA, same look)."""
    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=PLOT_DPI)
    plt.close(fig)
    out = io.BytesIO()
    Image.open(buf).convert("RGB").quantize(colors=64).save(out, format="PNG", optimize=True)
    plot = Plot(name, title, f"plots/{name}.png")
    atomic_write(run_dir / plot.path, lambda p: p.write_bytes(out.getvalue()))
    return plot


def _plots(run_dir: Path, report: RunReport, metrics_path: Path | None) -> list[Plot]:
    """Each plot the run has numbers for; one that fails is a warning in report.json, not a lost report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = (report.stages.evaluate or EvaluateEntry()).record()
    made = []
    for name, draw in (("train_loss", lambda: _train_plot(plt, run_dir, metrics_path)),
                       ("acceptance", lambda: _acceptance_plot(plt, run_dir, ev)),
                       ("tau_per_category", lambda: _category_plot(plt, run_dir, _categories(ev),
                                                                   ev.sampling_temperature)),
                       ("tau_vs_data", lambda: _data_plot(plt, run_dir, report.decision))):
        try:
            plot = draw()
        except Exception as e:  # a plot must never hide the report itself
            plt.close("all")
            report.warnings.append(f"plot {name} failed: {type(e).__name__}: {e}")
            continue
        if plot:
            made.append(plot)
    return made


def _train_plot(plt, run_dir: Path, metrics_path: Path | None) -> Plot | None:
    if not (metrics_path and Path(metrics_path).exists()):
        return None
    recs = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    rows = [r for r in recs if r.get("kind", "train_step") == "train_step" and "loss" in r]
    vals = [r for r in recs if r.get("kind") == "val"]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    axes[0].plot(steps, [r["loss"] for r in rows], label="train")
    if vals:  # one validation pass per epoch, drawn at the last step of that epoch
        last = {r.get("epoch"): s for s, r in zip(steps, rows)}
        axes[0].plot([last.get(v["epoch"], 0) for v in vals], [v["loss"] for v in vals], "o-", label="validation")
        axes[0].legend(fontsize=8)
    axes[0].set(title="draft training loss (sum over TTT steps)", xlabel="step", ylabel="loss")
    n_ttt = max((len(r.get("acc") or []) for r in rows), default=0)
    for k in range(n_ttt):
        axes[1].plot(steps, [(r.get("acc") or [None] * n_ttt)[k] for r in rows], label=f"TTT step {k + 1}")
    axes[1].set(title="accuracy per TTT step", xlabel="step", ylim=(0, 1))
    if n_ttt:
        axes[1].legend(fontsize=8)
    return _save(fig, run_dir, "train_loss", "draft training loss and accuracy per TTT step")


def _acceptance_plot(plt, run_dir: Path, ev) -> Plot | None:
    """`ev`: evaluate's record (EvaluateReport, loose: StageEntry.record)."""
    pos = ev.per_position_acceptance
    if not pos:
        return None
    base = ev.per_position_acceptance_untrained or []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = range(1, len(pos) + 1)
    tau = ev.acceptance_length
    ax.bar([x - 0.2 for x in xs], pos, width=0.4, label="trained" + (f" (τ={tau:.2f})" if _isnum(tau) else ""))
    if base:
        tau0 = ev.acceptance_length_untrained
        ax.bar([x + 0.2 for x in list(xs)[: len(base)]], base, width=0.4,
               label="untrained" + (f" (τ={tau0:.2f})" if _isnum(tau0) else ""))
    ax.set_xticks(list(xs))
    ax.set(title="acceptance rate per draft position", xlabel="position", ylabel="accepted / drafts", ylim=(0, 1))
    ax.legend(fontsize=8)
    return _save(fig, run_dir, "acceptance", "acceptance rate per draft position")


def _category_plot(plt, run_dir: Path, cats: dict[str, BaseModel], temperature) -> Plot | None:
    """τ per prompt category: the trained draft at temperature 0, the untrained one, the trained one at
    the sampling temperature, and vLLM's n-gram speculation (tokens per target step, τ's convention over
    every step); the bars a category has no number for are left out."""
    series = [("acceptance_length", "trained, T=0"), ("acceptance_length_untrained", "untrained, T=0"),
              ("acceptance_length_sampled", f"trained, T={_num(temperature)}" if temperature else "trained, sampled"),
              ("tokens_per_step_ngram", "n-gram, T=0"), ("tokens_per_step_suffix", "suffix, T=0")]
    series = [(k, label) for k, label in series if any(_isnum(getattr(c, k, None)) for c in cats.values())]
    if not series:
        return None
    names = list(cats)
    fig, ax = plt.subplots(figsize=(max(5.0, min(9.0, 1.0 + 0.8 * len(names))), 3.4))
    width, top = 0.8 / max(1, len(series)), 1.0
    for j, (key, label) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
        ys = [getattr(cats[n], key, None) if _isnum(getattr(cats[n], key, None)) else 0.0 for n in names]
        ax.bar(xs, ys, width=width, label=label)
        top = max(top, *ys)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")  # τ = 1: no draft token accepted
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center",
                       fontsize=8)
    ax.set(title="acceptance length τ per prompt category", ylabel="τ (tokens per step)", ylim=(0, top * 1.25))
    ax.legend(fontsize=8, ncol=min(len(series), 3), loc="upper center")  # in a row (or two) above the bars
    return _save(fig, run_dir, "tau_per_category", "acceptance length per prompt category")


def curve_series(decision: Decision | None) -> list[tuple[str, list[CurvePoint]]]:
    """[(implementation, points)] of report.json's decision: this run's curve first, then each other implementation's
    (report/decision.py): one curve each, never joined."""
    if decision is None:
        return []
    mine = [("this run: " + (decision.implementation or NOT_RECORDED), decision.curve)]
    return [(k, v) for k, v in mine + list(decision.other_curves.items()) if v]


def _data_plot(plt, run_dir: Path, decision: Decision | None) -> Plot | None:
    """τ against the training data's size (log scale), one point per run of this dataset and target on the
    same prompts, with the best training-free option of each run; one pair of lines per implementation."""
    series = curve_series(decision)
    if sum(len(pts) for _, pts in series) < 2:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2 + 0.3 * len(series)))
    for i, (label, curve) in enumerate(series):
        xs = [p.train_tokens for p in curve]
        line, = ax.plot(xs, [p.tau for p in curve], "o-", label=f"τ, {label}")
        free = [(x, p.best_free) for x, p in zip(xs, curve) if _isnum(p.best_free)]
        if free:
            ax.plot([x for x, _ in free], [y for _, y in free], "s--", color=line.get_color(),
                    label=f"best training-free, {label}" if len(series) > 1 else "best training-free")
    ax.set_xscale("log", base=2)
    ax.set(title="τ against training data", xlabel="training tokens (per epoch)", ylabel="tokens per target step")
    ax.legend(fontsize=6 if len(series) > 1 else 8)
    return _save(fig, run_dir, "tau_vs_data", "acceptance length against training data")


# ------------------------------------------------------------------------------------------- report.md
# Every number goes through _num/_value: 4 significant digits, bytes in KB/MB/GB, lists shortened.
# Tables are narrow (stage | metric | value; one row per category): the Prefect UI renders table cells
# without wrapping, so a long cell widens the whole table past the page.

def _markdown(report: RunReport, plots: list[Plot], images: dict[str, str] | None = None) -> str:
    """report.md; `images` maps a plot name to its data URI (the reference definitions at the end)."""
    lines = [f"# eagle3-pipeline run `{report.run_id}`", "", f"**Status:** {report.status}", ""]
    lines += [f"- ⚠ warning: {_cell(w)[:600]}" for w in report.warnings] + ([""] if report.warnings else [])
    lines += _decision(report.decision)
    if report.error:
        lines += ["```", report.error[:4000], "```", ""]
    stages = report.stages
    summary = _summary(stages)
    if summary:
        lines += ["## Summary", ""] + summary + [""]
    by_name = {p.name: p for p in plots}
    cats = _category_table((stages.evaluate or EvaluateEntry()).record())
    if cats:
        lines += ["## Acceptance per prompt category", ""] + cats + [""]
        if "tau_per_category" in by_name:
            lines += [_image(by_name["tau_per_category"], images), ""]
    others = [p for p in plots if p.name not in ("tau_per_category", "tau_vs_data")]
    if others:
        lines += ["## Plots", ""] + [x for p in others for x in (_image(p, images), "")]
    table = _stage_table(stages)
    if table:
        lines += ["## Stages", ""] + table + [""]
    lines += _timings_table(report.timings)
    lines += ["", "## Artifacts", ""]
    for k in Artifacts.model_fields:
        v = getattr(report.artifacts, k)
        for item in (v if isinstance(v, list) else [v]):
            lines.append(f"- **{k}**: `{item}`")
    if images:
        lines += ["", "<!-- the plots, embedded (also in plots/*.png beside this file) -->"]
        lines += [f"[{p.name}]: {images[p.name]}" for p in plots if p.name in images]
    return "\n".join(lines) + "\n"


def _decision(d: Decision | None) -> list[str]:
    """Worth training? First: the decision in a sentence, then per category the trained τ against the best
    training-free option (tokens per target step over every decode step) and the margin."""
    if d is None or not d.says:
        return []
    out = ["## Worth training?", "", f"**{d.says[0].upper()}{d.says[1:]}.**", ""]
    rows = d.per_category
    if rows:
        out += ["| category | τ trained | best training-free | tok/step | margin |", "|---|---:|---|---:|---:|"]
        for name, r in rows.items():
            label = name if len(name) <= 24 else name[:23] + "…"
            margin = r.margin
            tau, free = (f"{x:.3f}" if _isnum(x) else "–" for x in (r.trained, r.best_free))
            method = (r.best_free_method or "–").split(",")[0]  # the implementation: in the sentence above
            out.append(f"| {_cell(label)} | {tau} | {method} | {free} | "
                       + (f"{margin:+.3f} {'✓' if margin > 0 else '✗'}" if _isnum(margin) else "–") + " |")
        out.append("")
    series = curve_series(d)
    if sum(len(pts) for _, pts in series) > 1:
        kind = "its regenerated answers" if series[0][1][0].data == "regenerated" else "its own answers"
        out += [f"τ against training data, the runs of this dataset ({kind}) and target on these prompts, one curve per "
                f"implementation (the draft's and baselines' vLLM version and runner, the suffix decoding backend), "
                f"never two on one curve (plots/tau_vs_data.png):", ""]
        out += [f"- {_cell(label)}: " + ", ".join(f"{_num(p.train_tokens)} tokens τ {p.tau:.3f}" for p in pts[:8])
                + (" …" if len(pts) > 8 else "") for label, pts in series] + [""]
    return out


def _image(plot: Plot, images: dict[str, str] | None) -> str:
    return f"![{plot.title}][{plot.name}]" if images and plot.name in images else f"![{plot.title}]({plot.path})"


def _summary(stages: Stages) -> list[str]:
    """The headline numbers as a list: τ trained vs untrained, τ sampled, speed-up, train mode, regenerate."""
    out = []
    ev = (stages.evaluate or EvaluateEntry()).record()
    tau, tau0 = ev.acceptance_length, ev.acceptance_length_untrained
    if _isnum(tau):
        out.append(f"- **Acceptance length τ** (temperature 0): **{tau:.3f}** trained"
                   + (f" vs {tau0:.3f} untrained" if _isnum(tau0) else "") + _impl(ev.trained, " on "))
    turns = ev.acceptance_length_per_turn
    if turns:
        out.append("- **τ per turn** (trained, temperature 0): " + ", ".join(
            f"{k} {v:.3f}" if _isnum(v) else f"{k} –" for k, v in turns.items()))
    out += _ngram_summary(ev, tau)
    out += _ngram_summary(ev, tau, "baseline_suffix")
    if ev.baseline_suffix_unavailable:
        out.append(f"- **suffix decoding baseline**: not measured: {_cell(str(ev.baseline_suffix_unavailable))}")
    temp, sampled = ev.sampling_temperature, ev.acceptance_length_sampled
    cats = _categories(ev)
    if not _isnum(sampled) and cats:  # the prompt-weighted mean over the categories that have it
        have = [(c.prompts or 1, c.acceptance_length_sampled) for c in cats.values()
                if _isnum(c.acceptance_length_sampled)]
        if have:
            sampled = sum(n * t for n, t in have) / sum(n for n, _ in have)
    if _isnum(sampled):
        warn = ev.sampling_warning
        out.append(f"- **τ at temperature {_num(temp) if _isnum(temp) else '> 0'}** (trained): {sampled:.3f}"
                   + (f" — ⚠ not a measure of the draft here: {warn}" if warn else ""))
    speedup = ev.speedup
    if _isnum(speedup):
        d = ev.speedup_detail or {}
        how = ""
        if _isnum(d.get("tokens_per_s_draft")) and _isnum(d.get("tokens_per_s_plain")):
            how = (f" ({_num(d['tokens_per_s_draft'])} vs {_num(d['tokens_per_s_plain'])} output tokens/s"
                   + (f", {d['rounds']} rounds" if d.get("rounds") else "") + ")")
        out.append(f"- **Speed-up** (output tokens/s with the draft ÷ without, temperature 0): "
                   f"**{speedup:.2f}×**{how}")
    costs = ev.engine_run_s or {}
    if any(_isnum(v) for v in costs.values()):
        out.append("- **What each number cost** (seconds of each engine's whole run): "
                   + ", ".join(f"{k} {_num(v, 3)} s" for k, v in costs.items() if _isnum(v)))
    out += _storage_summary(stages.preflight or StageEntry())
    out += _verify_summary((stages.verify or VerifyEntry()).record())
    out += _train_summary(stages.train or StageEntry())
    rg = stages.regenerate
    if rg:
        nums = [(k, rg.value(k)) for k in ("rows_in", "rows_out", "rows_quarantined", "tokens_generated")]
        text = ", ".join(f"{_num(v)} {k.replace('_', ' ')}" for k, v in nums if _isnum(v))
        version = rg.value("version")
        out.append("- **Regenerated** answers with the target: " + (text or "no numbers")
                   + (f" (version `{version}`)" if version else "") + _cut_answers(rg) + _repeating(rg))
    out += _data_summary(stages.prepare or StageEntry())
    return out


def _cut_answers(rg: StageEntry) -> str:
    """How many regenerated answers were kept though cut short (on_length: keep), by the limit they hit."""
    cut, turns = rg.value("answers_cut"), rg.value("turns_regenerated")
    if not isinstance(cut, dict):
        return ""
    n = sum(v for v in cut.values() if _isnum(v))
    of = f" of {_num(turns)}" if _isnum(turns) else ""
    if not n:
        return f"; none{of} answers cut short"
    return (f"; ⚠ **{_num(n)}{of} answers cut short** and kept (" + ", ".join(f"at {k}: {_num(v)}" for k, v in
                                                                            cut.items()) + ")")


def _repeating(rg: StageEntry) -> str:
    """How many kept answers are mostly a loop (regenerate/turns.repeats_itself)."""
    n, turns = rg.value("answers_repeating"), rg.value("turns_regenerated")
    if not _isnum(n) or not n:
        return ""
    if rg.value("on_repetition") == "end":  # not among the turns kept
        return (f"; {_num(n)} answers repeated themselves (fewer than half of their 8-token spans distinct): their "
                f"conversations end before them (on_repetition: end)")
    return (f"; ⚠ **{_num(n)}{f' of {_num(turns)}' if _isnum(turns) else ''} answers repeat themselves** (fewer "
            f"than half of their 8-token spans distinct; kept: the draft learns the loops)")


def _data_summary(pr: StageEntry) -> list[str]:
    """The training data's size: rows, tokens, the tokens trained on, rows cut at prepare.max_length."""
    rows, tokens, sup = pr.value("rows_out"), pr.value("tokens"), pr.value("supervised_tokens")
    if not _isnum(rows) or not _isnum(tokens):
        return []
    line = f"- **Training data:** {_num(rows)} rows, {_num(tokens)} tokens"
    if _isnum(sup):
        line += f", {_num(sup)} of them trained on (the loss mask)"
    cut = pr.value("rows_truncated")
    if _isnum(cut) and cut:
        line += f"; {_num(cut)} rows cut at prepare.max_length"
    return [line]


def _train_summary(tr: StageEntry) -> list[str]:
    """The training line: mode, steps, losses, hidden states on disk, how online rows were judged."""
    mode = tr.value("mode")
    if not mode:
        return []
    parts = [f"- **Training:** {mode}"]
    if _isnum(tr.value("steps")):
        parts.append(f"{_num(tr.value('steps'))} steps")
    for key, text in (("final_loss", "final loss {} (the last step's)"), ("val_loss", "held-out loss {}")):
        if _isnum(tr.value(key)):
            parts.append(text.format(_num(tr.value(key))))
    peak = tr.value("hidden_states_peak_bytes")
    if _isnum(peak):
        parts.append(f"hidden states on disk at peak {_bytes(peak)}")
    rec = tr.record()  # the train record, typed (TrainResult, every field optional)
    rc = rec.online.row_checks if rec.online is not None else None
    if rc is not None:
        judged = ["structure"] + [k for k in ("fingerprint", "identity") if getattr(rc, k)]
        parts.append(f"every row from the server judged ({', '.join(judged)}): {len(rc.flagged or [])} "
                     f"flagged and cleared by the target, {len(rc.unavailable or [])} not delivered")
    win = rec.window
    if win is not None and _isnum(win.peak_bytes) and _isnum(win.dataset_bytes):
        parts.append(f"the window held at most {_num(win.peak_shards)} of {_num(win.max_shards)} shards "
                     f"({_bytes(win.peak_bytes)}) against the dataset's {_bytes(win.dataset_bytes)} over "
                     f"{_num(win.shards)} shards, each verified before it was published; "
                     f"{_bytes(win.validation_bytes or 0)} of validation rows held for the run")
    return [", ".join(parts)]


def _verify_summary(rec) -> list[str]:
    """Which checks ran on how many records, and each learned check's clean margin (the largest deviation of
    a clean record against its limit): how near the gate came to failing clean data. `rec`: verify's record
    (VerifyResult, loose: StageEntry.record)."""
    c = rec.checks
    if c is None:
        return []
    fp, ident, pred = c.fingerprint, c.identity, c.prediction
    max_z = (ident.profile or {}).get("max_z") if ident else None
    surprise = (pred.surprise or {}).get("max_z") if pred else None
    margins = {"fingerprint": fp and fp.clean_margin, "identity": ident and ident.max_deviation,
               "norm_bounds": c.norm_bounds and c.norm_bounds.margin, "reference": c.reference and c.reference.max_rel_err,
               "invariance": c.invariance and c.invariance.max_rel_err, "prediction": pred and pred.max_z}
    what = {"fingerprint": "largest error {} of the tolerance", "norm_bounds": "largest deviation {} of the bound",
            "identity": "largest deviation {}" + (f" of {max_z:g}" if _isnum(max_z) else ""),
            "reference": "max relative error {}", "invariance": "max relative error {}",
            "prediction": "largest z {} of a kept row" + (f", surprise largest z {_num(surprise, 3)}"
                                                          if _isnum(surprise) else "")}
    ran, skipped = [], []
    for name in type(c).model_fields:
        check = getattr(c, name)
        if check is None:  # a record written before this check existed
            continue
        if check.ran:
            m = margins.get(name)
            ran.append(f"{name} ({_num(check.records)} records"
                       + (f"; {what[name].format(_num(m, 3))}" if _isnum(m) else "") + ")")
        else:
            skipped.append(f"{name} ({check.skipped or 'not run'})")
    out = [f"- **Verify** {'passed' if rec.passed else 'FAILED'}: " + ", ".join(ran)
           + (f"; skipped: {', '.join(skipped)}" if skipped else "")]
    power = (c.reference.power if c.reference else None) or {}
    if power.get("says") and power.get("sampled"):
        out.append(f"- **Reference sample**: {_num(power['sampled'])} of {_num(power['rows'])} rows recomputed with "
                   f"the target: {power['says']}")
    if any(s.startswith("reference ") for s in skipped):
        out.append("- **Unproven**: the reference did not run, so no row's computation and no aux slot's layer "
                   "was checked against the target itself")
    return out


def _storage_summary(pre: StageEntry) -> list[str]:
    """The records' dtype and why (preflight: extract.storage_dtype, auto by the target's hidden size), their bytes,
    and the bandwidth the topology asks of the store."""
    dtype, why = pre.value("storage_dtype"), pre.value("storage_reason")
    if not dtype:
        return []
    line = f"- **Records stored as {dtype}**" + (f": {_cell(str(why))}" if why else "")
    per, total, free = pre.value("bytes_per_token"), pre.value("estimated_bytes"), pre.value("free_bytes")
    if _isnum(per) and _isnum(total):
        line += f"; {_num(per)} B per token, ~{_num(total / 1e9)} GB on the store" + (
            f" of {_num(free / 1e9)} GB free" if _isnum(free) else "")
    write, read = pre.value("write_bytes_per_s"), pre.value("read_bytes_per_s")
    if _isnum(write):
        line += f"; extraction writes ~{_num(write / 1e9)} GB/s"
    if _isnum(read):
        line += f"; training reads at least {_num(read / 1e6)} MB/s to meet its deadline"
    return [line]


def _impl(entry, sep: str = "; ") -> str:
    """The implementation that measured a number (evaluate/implementation.py), for the text; '' when not recorded."""
    impl = getattr(entry, "implementation", None)
    return f"{sep}{_cell(str(impl.name))}" if impl is not None and impl.name else ""


def _ngram_summary(ev, tau, key: str = "baseline_ngram") -> list[str]:
    """A training-free baseline (n-gram, or suffix decoding with `key` baseline_suffix) beside τ: tokens per
    target step over every decode step (τ's convention), how often it proposed, vLLM's own mean acceptance
    length over those steps, the tokens per step that reached the answers (without those a stop token or
    max_tokens cut off), and what it cost."""
    base = getattr(ev, key)
    if base is None or not _isnum(base.tokens_per_step):
        return []
    k, depth = base.num_speculative_tokens, getattr(base, "max_tree_depth", None)
    lo, hi = getattr(base, "prompt_lookup_min", None), getattr(base, "prompt_lookup_max", None)
    how = "".join(x for x in (f", k={k}" if _isnum(k) else "", f", n {lo}–{hi}" if _isnum(lo) and _isnum(hi) else "",
                              f", tree depth {depth}" if _isnum(depth) else ""))
    what = "suffix decoding baseline** (vLLM `method: suffix`" if key == "baseline_suffix" else \
        "n-gram baseline** (vLLM prompt lookup"
    line = (f"- **{what}, no draft{how}{_impl(base)}): **{base.tokens_per_step:.3f}** tokens "
            "per target step" + (f" vs τ {tau:.3f} trained" if _isnum(tau) else ""))
    steps, proposed = base.steps, base.proposed_steps
    if _isnum(steps) and _isnum(proposed):
        line += f" (over all {_num(steps)} decode steps; it proposed on {_num(proposed)}"
        mal = base.acceptance_length_proposed
        line += (f", vLLM's mean acceptance length over those {mal:.3f})" if _isnum(mal) else ")")
    out_ng, out_tr = base.output_tokens_per_step, ev.trained.output_tokens_per_step if ev.trained else None
    if _isnum(out_ng):  # confirmed tokens a stop token or max_tokens cut off count in τ, not in the answers
        line += (f"; tokens that reached the answers per step {out_ng:.3f}"
                 + (f" vs {out_tr:.3f} trained" if _isnum(out_tr) else ""))
    if _isnum(base.speedup):
        line += f"; speed-up {base.speedup:.2f}×"
    if _isnum(base.run_s):
        start = base.engine_start_s
        line += f"; cost {_secs(base.run_s)} s" + (f" (engine start {_secs(start)} s)" if _isnum(start) else "")
    if base.lossless_mismatches:
        line += (f" — ⚠ {_num(base.lossless_mismatches)}/{_num(base.lossless_checked)} prompts differ "
                 f"from the {_cell(str(base.lossless_reference))} decoding")
    return [line]


def _categories(ev) -> dict[str, BaseModel]:
    return {str(k): v for k, v in (ev.per_category or {}).items() if v is not None}


def _category_table(ev) -> list[str]:
    cats = _categories(ev)
    if not cats:
        return []
    temp = ev.sampling_temperature
    cols = [("prompts", "prompts"), ("acceptance_length", "τ trained"), ("acceptance_length_untrained", "τ untrained"),
            ("acceptance_length_sampled", f"τ at T={_num(temp)}" if _isnum(temp) else "τ sampled"),
            ("tokens_per_step_ngram", "n-gram tok/step"), ("tokens_per_step_suffix", "suffix tok/step"),
            ("per_position_acceptance", "accepted per position")]
    cols = [(k, h) for k, h in cols if any(getattr(c, k, None) is not None for c in cats.values())]
    out = ["| category | " + " | ".join(h for _, h in cols) + " |",
           "|---|" + "|".join("---" if k == "per_position_acceptance" else "---:" for k, _ in cols) + "|"]
    for name, c in cats.items():
        vals = {k: getattr(c, k, None) for k, _ in cols}
        cells = [_positions(v) if k == "per_position_acceptance" and isinstance(v, list)
                 else f"{v:.3f}" if k.startswith(("acceptance_length", "tokens_per_step")) and _isnum(v)
                 else _value(k, v) for k, v in vals.items()]
        label = name if len(name) <= 24 else name[:23] + "…"  # the table must fit the page: cells never wrap
        out.append(f"| {_cell(label)} | " + " | ".join(cells) + " |")
    return out


def _positions(rates: list) -> str:
    """Acceptance per draft position in a few characters: 0.64 / 0.43 / 0.35 (the first 5 positions)."""
    shown = " / ".join(f"{x:.2f}" if _isnum(x) else "–" for x in rates[:5])
    return shown + (" / …" if len(rates) > 5 else "")


def _stage_table(stages: Stages) -> list[str]:
    """One small table per stage (its name the header, metric | value rows; details stay in report.json):
    the Prefect UI gives a table at most a screen's height and scrolls the rest inside it."""
    out = []
    for name, st in stages.entries().items():
        rows = [f"| {k.replace('_', ' ')} | {_value(k, v)} |" for k, v in st.contract().items()
                if not isinstance(v, (dict, BaseModel))]  # per_category has its own table, a baseline its line
        if rows:
            out += [f"| {name} | |", "|---|---:|", *rows, ""]
    return out[:-1]


def _timings_table(timings: dict[str, StageTiming]) -> list[str]:
    """Where the run's time went: wall seconds per stage, the engine start-up part of it, the rest."""
    if not timings:
        return []
    out = ["", "## Time", "", "| stage | seconds | engine start s | work s |", "|---|---:|---:|---:|"]
    total = 0.0
    for name, t in timings.items():
        s, e = t.seconds or 0.0, t.engine_start_s
        total += s
        out.append(f"| {name} | {_secs(s)} | {'-' if e is None else _secs(e)} | {_secs(s - (e or 0.0))} |")
        for key, what in (("baseline_suffix", "suffix decoding"), ("baseline_ngram", "n-gram")):
            b, be = getattr(t, f"{key}_s"), getattr(t, f"{key}_engine_start_s")
            if _isnum(b):  # a part of the row above, not added to the total again
                out.append(f"| ↳ of which {what} baseline | {_secs(b)} | {_secs(be) if _isnum(be) else '-'} | "
                           f"{_secs(b - (be if _isnum(be) else 0.0))} |")
    starts = sum(t.engine_start_s or 0.0 for t in timings.values())
    out.append(f"| **total** | **{_secs(total)}** | **{_secs(starts)}** | **{_secs(total - starts)}** |")
    return out


def _secs(s: float) -> str:
    return f"{s:.1f}" if abs(s) < 10_000 else f"{s:,.0f}"


def _isnum(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v, digits: int = 4) -> str:
    """A number as a reader wants it: `digits` significant digits, thousands separated, 1.235 M past a million."""
    if not _isnum(v):
        return "–" if v is None or isinstance(v, float) else str(v)  # nan, inf: null in report.json
    if isinstance(v, int) and abs(v) < 1_000_000:
        return f"{v:,}"
    if abs(v) >= 1_000_000:
        for unit, scale in (("G", 1e9), ("M", 1e6)):
            if abs(v) >= scale:
                return f"{v / scale:.{digits}g} {unit}"
    if abs(v) >= 10 ** digits:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def _bytes(v) -> str:
    if not _isnum(v):
        return _num(v)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{int(v)} B"


def _value(key: str, v) -> str:
    """One table cell: numbers rounded, bytes in units, booleans as yes/no, lists shortened, paths and
    hashes as short code spans (the whole paths are in the artifact list)."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if _isnum(v):
        return _bytes(v) if "bytes" in key else _num(v)
    if isinstance(v, float):  # nan, inf: null in report.json
        return "–"
    if isinstance(v, (list, tuple)):
        return _short(list(v))
    if isinstance(v, dict):
        return f"{len(v)} entries"
    s = str(v)
    if "/" in s and len(s) > 32:
        s = "…/" + "/".join(Path(s).parts[-2:])
    if len(s) > 40:
        s = s[:39] + "…"
    return f"`{s}`" if " " not in s else _cell(s)


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _short(v) -> str:
    """A value in a few characters: floats at 3 significant digits, at most 6 list items shown."""
    if isinstance(v, float):
        return _num(v, 3)
    if isinstance(v, list):
        items = ", ".join(_short(x) for x in v[:6])
        return f"[{items}, … {len(v)} in all]" if len(v) > 6 else f"[{items}]"
    return _num(v) if _isnum(v) else str(v)


def write_report(run_dir: Path, rec: RunReport, metrics_path: Path | None = None) -> dict[str, str]:
    """Write report.json, report.md (plots embedded) and plots/*.png; returns their paths."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plots: list[Plot] = []
    rec = rec.model_copy(deep=True)
    try:
        plots = _plots(run_dir, rec, metrics_path)  # a plot that fails adds its warning to rec
    except Exception as e:  # e.g. matplotlib missing
        rec.warnings.append(f"plots failed: {type(e).__name__}: {e}")
    rec.artifacts.report_md = str((run_dir / "report.md").resolve())
    rec.artifacts.plots = [str((run_dir / p.path).resolve()) for p in plots]
    report = rec.to_json()
    write_json(run_dir / "report.json", report)
    try:
        md = _markdown(rec, plots, {p.name: p.data_uri(run_dir) for p in plots})
    except Exception as e:  # neither may a rendering bug: report.json is written, report.md says what failed
        md = (f"# eagle3-pipeline run `{rec.run_id}`\n\n**Status:** {rec.status}\n\n"
              f"report.md could not be rendered ({type(e).__name__}: {e}); report.json beside it has everything.\n")
    atomic_write_text(run_dir / "report.md", md)
    return {"report_json": str(run_dir / "report.json"), "report_md": str(run_dir / "report.md")}


class ReportInputs(BaseModel):
    """build_report's inputs but the config (the entry's `cfg`), as report/runs.py RunDir.report_record gathers them."""
    run_id: str
    versions: dict  # the installed packages that matter (preflight.installed_versions)
    stages: dict[str, Any]  # each stage's record as JSON, by stage name
    artifacts: dict[str, str | None]  # where the run's data and draft are
    status: str
    error: str | None = None
    timings: dict = {}  # runs.StageClock.timings
    curve: list[CurvePoint] | None = None


def run(cfg: PipelineConfig, inputs: ReportInputs, log: Log) -> RunReport:
    """The stage's entry (StageSpec.run): report.json's record of a run under `cfg`."""
    return build_report(inputs.run_id, cfg.model_dump(mode="json"), inputs.versions, inputs.stages, inputs.artifacts,
                        inputs.status, inputs.error, timings=inputs.timings, curve=inputs.curve)


RETRY = Retry(1, 5, IO, "writes report.json/md and plots")
STAGE = StageSpec(name="report", run=run, result=RunReport, failure=None, reported=False, retry=RETRY)
