"""The `eagle3` command: launches flows (so it lives beside them, not in the core)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="eagle3-pipeline: target LLM + chat data -> EAGLE-3 draft")
console = Console()

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", exists=True, dir_okay=False, help="pipeline YAML")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override, e.g. --set train.epochs=2")]


@app.command()
def run(config: ConfigOpt, output_dir: Annotated[Path, typer.Option(help="where runs/<run-id>/ go")] = Path("runs"),
        set_: SetOpt = None) -> None:
    """Run the whole pipeline; prints where the report is."""
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.runs import create_run_dir
    from flows.pipeline import pipeline

    cfg = load_config(config, set_ or [])
    run_dir = create_run_dir(output_dir, cfg)
    console.print(f"[bold]run[/] {run_dir.name} -> {run_dir}")
    try:
        pipeline(config=cfg, run_dir=str(run_dir))
    except Exception as e:
        console.print(f"[red bold]pipeline failed:[/] {type(e).__name__}: {e}")
        console.print(f"report: {run_dir / 'report.md'}")
        raise typer.Exit(1) from None
    rep = json.loads((run_dir / "report.json").read_text())
    ev = rep["stages"].get("evaluate", {})
    console.print(f"[green bold]done[/]: τ = {ev.get('acceptance_length')} (untrained {ev.get('acceptance_length_untrained')})")
    console.print(f"report: {run_dir / 'report.md'}\n        {run_dir / 'report.json'}")


@app.command("make-tiny-target")
def make_tiny_target(out: Annotated[Path, typer.Option(help="model directory to write")] = Path(".cache/tiny-target"),
                     force: bool = False,
                     steps: Annotated[int | None, typer.Option(help="training steps (default: the tiny config's)")] = None) -> None:
    """Build the embedded default: procedural corpus, BPE tokenizer, a tiny Llama trained on it."""
    from eagle3_pipeline.tiny.target import TinyTargetConfig, build_tiny_target

    if (out / "tiny_target.json").exists() and not force:
        s = json.loads((out / "tiny_target.json").read_text())
        console.print(f"tiny target already built at {out} (greedy accuracy {s['greedy_accuracy']:.2f}); --force rebuilds")
        return
    cfg = TinyTargetConfig(**({"max_steps": steps} if steps else {}))
    s = build_tiny_target(cfg, out, log=console.print)
    console.print(f"[green]tiny target[/] {out}: {s['params']:,} params, greedy accuracy {s['greedy_accuracy']:.2f}, "
                  f"{s['build_seconds']:.0f}s")


@app.command()
def prepare(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Run only the prepare stage (content-addressed: a repeated call reuses the version)."""
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.stages import stage_prepare

    rec = stage_prepare(load_config(config, set_ or []), log=console.print)
    console.print_json(data={k: rec[k] for k in ("version", "dir", "rows_in", "rows_out", "rows_quarantined", "tokens")})


@app.command("rerun-failed")
def rerun_failed(config: ConfigOpt, set_: SetOpt = None,
                 force_shards: Annotated[list[int] | None, typer.Option("--force-shard", help="re-extract this shard even if published")] = None) -> None:
    """Re-extract the failed/unpublished shards of this config's extract version, then verify."""
    from eagle3_pipeline.config import load_config
    from flows.rerun_failed import rerun_failed as flow_

    try:
        rec = flow_(config=load_config(config, set_ or []), force_shards=force_shards or [])
    except Exception as e:
        console.print(f"[red bold]rerun-failed:[/] {type(e).__name__}: {e}")
        raise typer.Exit(1) from None
    console.print(f"[green]verified[/] {rec['samples_checked']} records, reference max rel err {rec['reference_max_rel_err']}")


@app.command()
def extract(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Prepare (from the store when unchanged), preflight, and extract with a live progress bar."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from eagle3_pipeline import stages
    from eagle3_pipeline.config import load_config

    cfg = load_config(config, set_ or [])
    prep = stages.stage_prepare(cfg, log=console.print)
    pre = stages.stage_preflight(cfg, prep, log=console.print)
    plan = stages.stage_extract_plan(cfg, prep, pre)
    n = sum(len(g) for g in plan["groups"])
    with Progress(TextColumn("extract"), BarColumn(), TextColumn("{task.completed}/{task.total} shards"),
                  TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TextColumn("ETA"),
                  TimeRemainingColumn(), console=console) as bar:
        job = bar.add_task("extract", total=n, tps="-")
        seen = {"tokens": 0, "seconds": 0.0}

        def on_shard(ev: dict) -> None:
            seen["tokens"] += ev["tokens"]
            seen["seconds"] += ev["seconds"]
            bar.update(job, advance=1, tps=f"{seen['tokens'] / max(seen['seconds'], 1e-9):,.0f}")

        for group in plan["groups"]:
            recs = stages.stage_extract_group(cfg, prep, plan, group, log=bar.console.print, on_shard=on_shard)
            bar.update(job, advance=sum(r["reused"] for r in recs))
    console.print_json(data=stages.stage_extract_summary(plan))


@app.command()
def status(output_dir: Annotated[Path, typer.Option()] = Path("runs")) -> None:
    """Show the latest run's report summary."""
    rep_path = output_dir / "latest" / "report.json"
    if not rep_path.exists():
        console.print(f"no run yet under {output_dir}")
        raise typer.Exit(1)
    rep = json.loads(rep_path.read_text())
    console.print(f"run {rep['run_id']}: {rep['status']}")
    for name, st in rep["stages"].items():
        console.print(f"  {name:9s} " + ", ".join(f"{k}={v}" for k, v in st.items() if k != "details"))


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
