"""The run report: `report.json` (the stable contract of DESIGN §2), `report.md` and PNG plots.

Reads the small records each stage returned (dicts) and `metrics.jsonl` of training. Writes into the
run directory: report.json, report.md, plots/train_loss.png, plots/acceptance.png. Always written,
also when a stage failed: missing stages appear as absent with the error text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.store import atomic_write_text, write_json

STAGES = ("regenerate", "prepare", "preflight", "extract", "verify", "vocab", "train", "evaluate")
# report.json fields per stage (the contract); other keys a stage returns are kept under "details"
CONTRACT = {
    "regenerate": ("version", "rows_in", "rows_out", "rows_quarantined", "tokens_generated"),
    "prepare": ("version", "rows_in", "rows_out", "rows_quarantined", "tokens"),
    "extract": ("layer_ids", "shards_total", "shards_published", "tokens", "tokens_per_s", "bytes_on_disk",
                "rows_extracted", "rows_reused"),
    "verify": ("passed", "samples_checked", "reference_max_rel_err", "shards_rechecked", "shards_reused",
               "reference_peak_rss_bytes"),
    "vocab": ("draft_vocab_size", "coverage"),
    "train": ("mode", "world_size", "steps", "final_loss", "tokens_per_s"),
    "evaluate": ("acceptance_length", "acceptance_length_untrained", "per_position_acceptance"),
}


def build_report(run_id: str, config: dict, versions: dict, stages: dict[str, dict], artifacts: dict[str, str],
                 status: str, error: str | None = None, timings: dict[str, dict] | None = None) -> dict:
    """report.json's record; `timings` is {stage: {"seconds", "engine_start_s"}} (runs.StageClock)."""
    out_stages: dict[str, Any] = {}
    for name in STAGES:
        rec = stages.get(name)
        if rec is None:
            continue
        keys = CONTRACT.get(name, ())
        entry = {k: rec.get(k) for k in keys}
        entry["details"] = {k: v for k, v in rec.items() if k not in keys}
        out_stages[name] = entry
    return {"run_id": run_id, "status": status, "error": error, "config": config, "versions": versions,
            "timings": timings or {}, "stages": out_stages, "artifacts": artifacts}


def _plots(run_dir: Path, report: dict, metrics_path: Path | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    plots = run_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    if metrics_path and Path(metrics_path).exists():
        recs = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
        rows = [r for r in recs if r.get("kind", "train_step") == "train_step" and "loss" in r]
        vals = [r for r in recs if r.get("kind") == "val"]
        if rows:
            fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
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
            fig.tight_layout()
            fig.savefig(plots / "train_loss.png", dpi=90)
            plt.close(fig)
            made.append("plots/train_loss.png")
    ev = report["stages"].get("evaluate")
    if ev and ev.get("per_position_acceptance"):
        pos = ev["per_position_acceptance"]
        base = (ev.get("details") or {}).get("per_position_acceptance_untrained") or []
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = range(1, len(pos) + 1)
        ax.bar([x - 0.2 for x in xs], pos, width=0.4, label=f"trained (τ={ev['acceptance_length']:.2f})")
        if base:
            ax.bar([x + 0.2 for x in list(xs)[: len(base)]], base, width=0.4,
                   label=f"untrained (τ={ev.get('acceptance_length_untrained') or 0:.2f})")
        ax.set_xticks(list(xs))
        ax.set(title="acceptance rate per draft position", xlabel="position", ylabel="accepted / drafts", ylim=(0, 1))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plots / "acceptance.png", dpi=90)
        plt.close(fig)
        made.append("plots/acceptance.png")
    return made


def _markdown(report: dict, plots: list[str]) -> str:
    lines = [f"# eagle3-pipeline run `{report['run_id']}`", "", f"**Status:** {report['status']}", ""]
    if report.get("error"):
        lines += ["```", report["error"][:4000], "```", ""]
    ev = report["stages"].get("evaluate")
    if ev:
        lines += [f"**Acceptance length τ:** {ev['acceptance_length']:.3f} trained vs "
                  f"{(ev.get('acceptance_length_untrained') or float('nan')):.3f} untrained", ""]
    lines += ["| stage | key numbers |", "|---|---|"]
    for name, st in report["stages"].items():
        nums = ", ".join(f"{k}={_short(v)}" for k, v in st.items() if k != "details")
        lines.append(f"| {name} | {nums} |")
    lines += _timings_table(report.get("timings") or {})
    lines += [""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Artifacts", ""] + [f"- **{k}**: `{v}`" for k, v in report["artifacts"].items()]
    return "\n".join(lines) + "\n"


def _timings_table(timings: dict[str, dict]) -> list[str]:
    """Where the run's time went: wall seconds per stage, the engine start-up part of it, the rest."""
    if not timings:
        return []
    out = ["", "## Time", "", "| stage | seconds | engine start s | work s |", "|---|---:|---:|---:|"]
    total = 0.0
    for name, t in timings.items():
        s, e = t.get("seconds") or 0.0, t.get("engine_start_s")
        total += s
        out.append(f"| {name} | {s:.1f} | {'-' if e is None else f'{e:.1f}'} | "
                   f"{s - (e or 0.0):.1f} |")
    starts = sum(t.get("engine_start_s") or 0.0 for t in timings.values())
    out.append(f"| **total** | **{total:.1f}** | **{starts:.1f}** | **{total - starts:.1f}** |")
    return out


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 6:
        return f"[{', '.join(_short(x) for x in v[:6])}, …]"
    if isinstance(v, list):
        return "[" + ", ".join(_short(x) for x in v) + "]"
    return str(v)


def write_report(run_dir: Path, report: dict, metrics_path: Path | None = None) -> dict[str, str]:
    """Write report.json, report.md and plots; returns their paths."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    try:
        plots = _plots(run_dir, report, metrics_path)
    except Exception as e:  # a plot must never hide the report itself
        report.setdefault("warnings", []).append(f"plots failed: {type(e).__name__}: {e}")
    report["artifacts"]["report_md"] = str((run_dir / "report.md").resolve())
    report["artifacts"]["plots"] = [str((run_dir / p).resolve()) for p in plots]
    write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", _markdown(report, plots))
    return {"report_json": str(run_dir / "report.json"), "report_md": str(run_dir / "report.md")}
