"""The train stage: offline data + draft vocab -> an EAGLE-3 draft checkpoint that vLLM serves.

More: docs/internals.md, "train/stage.py".
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig, TargetConfig, TrainConfig
from eagle3_pipeline.core.proc import python_child, run_child
from eagle3_pipeline.core.progress import interval
from eagle3_pipeline.core.stage_spec import CHILD, IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import atomic_write_text, content_key, dir_lock, read_json, sha256_file, write_json
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.records.contracts import HS_KEY, TOKENS_KEY, ContractError, record_name
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.lineage import PreviousDraft, previous_draft
from eagle3_pipeline.records.results import (  # the stage's record (records/results.py)
    UNTRAINED_DIR,
    TrainResult,
    VocabResult,
)
from eagle3_pipeline.records.vocab import load_vocab, vocab_paths
from eagle3_pipeline.train.accumulate import recover
from eagle3_pipeline.train.export import export_check
from eagle3_pipeline.train.job import OnlineSource, TrainJob, TrainOutput, WindowSource
from eagle3_pipeline.train.nodes import publish
from eagle3_pipeline.train.topology import SET_DIR_ENV, Fit, TrainSet, fit, topology, train_set

WORKER = "eagle3_pipeline.train.worker"
NODES = "eagle3_pipeline.train.nodes"  # a local multi-node set's launcher
SET_NAME = "train_set.json"  # beside train_job.json: the local set's agents (topology.TrainSet)
RECORD_NAME = "train_record.json"  # the TrainResult of the last completed train_draft (export-checked)
CKPT_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "training_state.json")


def _check_inputs(version: ExtractVersion) -> int:
    """Every row has its hs file; the first and last files have [T, L, H] as expected. Returns rows."""
    from safetensors import safe_open


    tokenized_dir, hidden_states_dir = version.tokenized_dir, version.hidden_states_dir
    num_captured, hidden_size = len(version.layer_ids), version.dims.hidden_size
    ds = load_tokenized(tokenized_dir)
    missing_cols = {"input_ids", "loss_mask", "seq_len"} - set(ds.column_names)
    if missing_cols:
        raise ContractError(f"{tokenized_dir}: missing columns {sorted(missing_cols)} (found {ds.column_names})")
    n = len(ds)
    if n == 0:
        raise ContractError(f"{tokenized_dir}: no rows")
    missing = [i for i in range(n) if not version.record_path(i).exists()]
    if missing:
        raise ContractError(f"{hidden_states_dir}: {len(missing)} of {n} rows have no hidden-state file "
                            f"(first: {record_name(missing[0])})")
    for i in sorted({0, n - 1}):
        p = version.record_path(i)
        t = int(ds[i]["seq_len"])
        with safe_open(str(p), framework="pt") as f:
            keys = set(f.keys())
            if not {HS_KEY, TOKENS_KEY} <= keys:
                raise ContractError(f"{record_name(i)}: expected tensors {HS_KEY!r}, {TOKENS_KEY!r}; found {sorted(keys)}")
            shape = list(f.get_slice(HS_KEY).get_shape())
        if shape != [t, num_captured, hidden_size]:
            raise ContractError(f"{record_name(i)}: {HS_KEY} expected [{t}, {num_captured}, {hidden_size}] "
                                f"(seq_len of row {i}, {num_captured} captured layers, hidden size), found {shape}")
    return n


def _val_losses(metrics_path: Path) -> dict[int, float | None] | None:
    """{epoch: validation loss} from metrics.jsonl (None: no metrics file, nothing is known)."""
    if not metrics_path.exists():
        return None
    out: dict[int, float | None] = {}
    for raw in metrics_path.read_text().splitlines():
        try:
            d = json.loads(raw)
        except json.JSONDecodeError:  # a line cut off by a kill
            continue
        if d.get("kind") == "val" and isinstance(d.get("epoch"), int):
            out[d["epoch"]] = d.get("loss")
    return out


def _unfinished_epoch(save_path: Path, epoch: int, vals: dict[int, float | None]) -> str | None:
    """Why the complete checkpoint of `epoch` (the last one) must not be resumed from, or None.
    speculators saves an epoch's checkpoint *before* validating it and moving checkpoint_best, and
    resumes with the next epoch: a kill in between would leave that epoch never validated, and
    checkpoint_best possibly on a worse epoch than a run without the kill."""
    try:
        state = read_json(save_path / str(epoch) / "training_state.json") or {}
    except ValueError:  # unreadable: not a step checkpoint we could resume within
        state = {}
    if isinstance(state, dict) and state.get("epoch") == epoch and (state.get("local_step") or 0) > 0:
        return None  # a step checkpoint inside the epoch: speculators resumes within it, validation comes later
    if epoch not in vals:
        return "its validation never finished"
    loss, earlier = vals[epoch], [v for e, v in vals.items() if e < epoch and v is not None]
    best = save_path / "checkpoint_best"
    if loss is not None and loss < min(earlier, default=float("inf")) and \
            not (best.is_symlink() and os.readlink(best) == str(epoch)):
        return "its validation was the best so far but checkpoint_best was not moved to it"
    return None


def _move_incomplete_checkpoints(save_path: Path, log: Callable[[str], None]) -> None:
    """An epoch dir without all of CKPT_FILES (a killed save) would be resumed from: move it aside.
    So is the last complete one when metrics.jsonl shows that the attempt died before its epoch's
    validation and checkpoint_best update were done (`_unfinished_epoch`): that epoch is trained again."""
    if not save_path.is_dir():
        return
    recover(save_path, log)  # a save cut short between its staging dir and its place (train/accumulate.py)
    interrupted = save_path / "interrupted"  # speculators' save on SIGTERM/SIGINT; a new one means this attempt was stopped
    if interrupted.is_dir() and not interrupted.is_symlink():
        dest = interrupted.with_name(f"interrupted.{int(time.time())}")
        log(f"train: {interrupted} (saved by a stopped attempt; not resumed from) moved to {dest.name}")
        interrupted.rename(dest)
    for d in sorted(save_path.iterdir()):
        if d.is_dir() and not d.is_symlink() and d.name.isdigit():
            absent = [f for f in CKPT_FILES if not (d / f).exists()]
            if absent:
                dest = d.with_name(f"{d.name}.incomplete-{int(time.time())}")
                log(f"train: checkpoint {d} is incomplete (no {absent}); moved to {dest.name}, not resumed from")
                d.rename(dest)
    vals = _val_losses(save_path.parent / "metrics.jsonl")
    complete = sorted((d for d in save_path.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()),
                      key=lambda d: int(d.name))
    if vals is not None and complete and (why := _unfinished_epoch(save_path, int(complete[-1].name), vals)):
        d = complete[-1]
        dest = d.with_name(f"{d.name}.incomplete-{int(time.time())}")
        log(f"train: checkpoint {d} is complete but {why}; moved to {dest.name}, not resumed from")
        d.rename(dest)
    for link in save_path.iterdir():  # links (checkpoint_best, epochN_end) to what was moved
        if link.is_symlink() and not link.exists():
            link.unlink()


def _check_resume_spec(out_dir: Path, save_path: Path, spec: dict) -> None:
    """Checkpoints in `save_path` must have been trained for the same draft (architecture, vocab,
    layers); otherwise resuming would silently load the old d2t/t2d and weights. Records the spec."""
    path = out_dir / "train_spec.json"
    old = read_json(path)
    has_ckpt = save_path.is_dir() and any(d.name.isdigit() for d in save_path.iterdir())
    if old is not None and has_ckpt and old != spec:
        diff = {k: (old.get(k), spec.get(k)) for k in sorted(set(old) | set(spec)) if old.get(k) != spec.get(k)}
        raise ValueError(f"{save_path}: holds checkpoints of a different draft, cannot resume; "
                         f"differs in {diff} (checkpoint, now). Use a new output dir.")
    write_json(path, spec)


def _format_event(ev: dict, total_steps: int | None = None) -> str | None:
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    kind = ev.get("kind")
    if kind == "train_step":
        acc = " ".join(f(a, ".2f") for a in ev.get("acc") or [])
        dropped = ev.get("error_records") or 0
        of = f"/{total_steps}" if total_steps else ""
        return (f"train: step {ev.get('step')}{of} epoch {ev.get('epoch')} loss {f(ev.get('loss'))} "
                f"acc[{acc}] {f(ev.get('tokens_per_s'), '.0f')} tok/s"
                + (f"; WARNING {dropped:.0f} rows dropped (hidden states missing or token_ids != input_ids)"
                   if dropped else ""))
    if kind == "val":
        acc = " ".join(f(a, ".2f") for a in ev.get("acc") or [])
        return f"train: validation epoch {ev.get('epoch')} loss {f(ev.get('loss'))} acc[{acc}]"
    if kind == "start":
        return (f"train: start (resumed from epoch {ev.get('resumed_from_epoch')}, step {ev.get('global_step')}); "
                f"{ev.get('train_batches_per_epoch')} packed rows/epoch, {ev.get('val_batches')} for validation, "
                f"{ev.get('params_trainable')} trainable parameters, {ev.get('compute_dtype')} compute, "
                f"{ev.get('threads')} threads, "
                f"child ready after {ev.get('startup_s')}s")
    if kind == "done":
        return f"train: done, {ev['steps']} steps" if "steps" in ev else "train: done"
    return None


def _argv(cfg: TrainConfig, job_path: Path, distributed: bool = True, tset: TrainSet | None = None) -> list[str]:
    """world_size > 1: torchrun starts world_size ranks of the worker on this node (`--standalone`: its own
    rendezvous on a free local port), one per GPU on cuda, gloo processes on cpu; the child's process group
    holds torchrun and every rank, so a timeout or cancel ends them all. nodes > 1 (`tset`): this node's
    torchrun agent of a cluster set, or the local set's launcher (train/nodes.py) with every node's agent."""
    if distributed and tset is not None:
        if tset.local:
            return python_child(NODES, "local", str(job_path.with_name(SET_NAME)))
        return tset.argv[tset.node_rank]
    if distributed and cfg.world_size > 1:
        return [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={cfg.world_size}", "-m", WORKER, str(job_path)]
    return python_child(WORKER, str(job_path))


def _run_worker(job: TrainJob, job_path: Path, log: Callable[[str], None], log_path: Path | None,
                timeout_s: float, distributed: bool = True) -> dict:
    cfg = job.train
    atomic_write_text(job_path, job.model_dump_json(indent=2))
    Path(job.result_path).unlink(missing_ok=True)  # never report a previous attempt's result

    total: list[int | None] = [None]  # optimizer steps of the whole run, from the start event (progress)
    # step lines at the extraction's cadence (every step is in metrics.jsonl): the first, one at most every
    # progress.interval() seconds, and the last before a validation or the end (held back until then)
    shown, held, every = [float("-inf")], [None], interval()

    def on_event(ev: dict):
        kind = ev.get("kind")
        if kind == "start" and ev.get("train_batches_per_epoch") and ev.get("epochs"):
            total[0] = int(ev["train_batches_per_epoch"]) * int(ev["epochs"])
            if cfg.max_steps:
                total[0] = min(total[0], cfg.max_steps)
        if kind == "train_step":
            now = time.monotonic()
            if ev.get("step") and not ev.get("error_records") and now - shown[0] < every:
                held[0] = ev
                return
            shown[0], held[0] = now, None
        elif held[0] is not None:  # a validation, the end: the step before it first
            log(_format_event(held[0], total[0]))
            held[0] = None
        line = _format_event(ev, total[0])
        if line:
            log(line)

    tset = _start_set(cfg, job_path, log) if distributed else None
    if distributed and tset is None and cfg.world_size > 1:
        log(f"train: {cfg.world_size} ranks on this node ({cfg.sharding})")
    timing = _Timing(cfg, log)
    run_child(_argv(cfg, job_path, distributed, tset), name="train", timeout_s=timeout_s, log_path=log_path,
              on_line=log, on_event=lambda ev: (timing.on_event(ev), on_event(ev)),
              env={"TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if tset is not None and not tset.local:
        publish(tset, _set_dir(), "done")  # the other pods' agents have ended: their pods may end too
    result = read_json(Path(job.result_path))
    if result is None:
        raise RuntimeError(f"train worker exited 0 without writing {job.result_path}")
    return {**result, "fit": timing.fit.model_dump() if timing.fit else None}


def _set_dir() -> Path:
    d = os.environ.get(SET_DIR_ENV)
    if not d:
        raise RuntimeError(f"train.nodes > 1 in a train set's pod needs {SET_DIR_ENV} (the GPU job template sets it)")
    return Path(d)


def _start_set(cfg: TrainConfig, job_path: Path, log: Callable[[str], None]) -> TrainSet | None:
    """nodes > 1: the set's agents (train/topology.py); a local set's record for its launcher, or a cluster
    set's record published on the store for the other pods (train/nodes.py)."""
    tset = train_set(cfg, str(job_path))
    if tset is None:
        return None
    topo = topology(cfg)
    log(f"train: {topo.nodes} nodes x {topo.ranks_per_node} ranks ({topo.sharding}), {topo.accumulation_steps} accumulation "
        f"step(s), {topo.global_batch_tokens} tokens per optimizer step; rendezvous {tset.endpoint} ({tset.id}, "
        + ("agents on this machine)" if tset.local else f"this pod is node {tset.node_rank})"))
    if tset.local:
        atomic_write_text(job_path.with_name(SET_NAME), tset.model_dump_json(indent=2))
    else:
        publish(tset, _set_dir())
    return tset


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


class _Timing:
    """Times the first train.estimate_after_steps logged steps of an attempt, then estimates the run's duration
    against train.timeout_s (topology.fit) and says so: a warning naming the node count that would fit."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None]):
        self.cfg, self.log, self.t0 = cfg, log, time.monotonic()
        self.total: int | None = None
        self.steps: list[dict] = []
        self.fit: Fit | None = None

    def on_event(self, ev: dict) -> None:
        if ev.get("kind") == "start" and ev.get("train_batches_per_epoch") and ev.get("epochs"):
            self.total = int(ev["train_batches_per_epoch"]) * int(ev["epochs"])
            self.total = min(self.total, self.cfg.max_steps or self.total)
        if ev.get("kind") != "train_step" or self.fit is not None or self.total is None:
            return
        self.steps.append(ev)
        timed = self.steps[1:]  # the attempt's first step carries warm-up (allocations, lazy inits)
        if len(timed) < self.cfg.estimate_after_steps:
            return
        secs = sum(e.get("step_s") or 0.0 for e in timed)
        rate = sum(e.get("tokens") or 0 for e in timed) / secs if secs > 0 else 0.0
        if rate <= 0:
            return
        left = self.total - int(ev.get("step") or 0) - 1
        self.fit = fit(self.cfg, rate, secs / len(timed), left, time.monotonic() - self.t0)
        f = self.fit
        said = (f"train: at {rate:,.0f} tok/s over {self.cfg.nodes} node(s), the run needs ~{_span(f.estimated_s)} "
                f"({left} steps left); the stage's deadline is {_span(f.deadline_s)} (train.timeout_s)")
        self.log(said + ": it fits" if f.fits else
                 f"{said}: WARNING it will not finish in time; train.nodes={f.nodes_to_fit} would fit "
                 f"(at the same tokens/s per node)")


def train_draft(cfg: TrainConfig, target: TargetConfig, version: ExtractVersion, vocab_dir: Path, out_dir: Path, *,
                log: Callable[[str], None] = print, previous=None,
                online: OnlineSource | WindowSource | None = None) -> TrainResult:
    """Train (or resume training) the EAGLE-3 draft on `version`'s records; see the module docstring
    for files. Holds `out_dir/.lock` throughout: two trainers never write one checkpoint dir (the
    second waits, then resumes from what the first left). `online` (job.OnlineSource): take every row's
    hidden states from that running server instead of the stored records (train/online.py); a
    job.WindowSource: the train rows from that capture window as capture publishes them (train/window_sampler.py;
    validation rows from the stored records)."""
    with dir_lock(Path(out_dir), f"train dir {out_dir}", log):
        return _train_draft(cfg, target, version, Path(vocab_dir), Path(out_dir), log, previous, online)


def _check_tokenized(version: ExtractVersion) -> int:
    """Online: the rows the server will be asked for exist and have the columns the loader reads."""
    ds = load_tokenized(version.tokenized_dir)
    missing_cols = {"input_ids", "loss_mask", "seq_len"} - set(ds.column_names)
    if missing_cols:
        raise ContractError(f"{version.tokenized_dir}: missing columns {sorted(missing_cols)} (found {ds.column_names})")
    if len(ds) == 0:
        raise ContractError(f"{version.tokenized_dir}: no rows")
    return len(ds)


def _train_draft(cfg: TrainConfig, target: TargetConfig, version: ExtractVersion, vocab_dir: Path, out_dir: Path,
                 log: Callable[[str], None], previous=None,
                 online: OnlineSource | WindowSource | None = None) -> TrainResult:
    """`previous` (lineage.PreviousDraft): initialise the draft from its checkpoint (a refresh)."""
    window, online = (online, None) if isinstance(online, WindowSource) else (None, online)
    dims, aux = version.dims, version.aux_layer_ids
    if why := cfg.topology_problem():
        raise ValueError(why)
    load_vocab(vocab_dir, dims.vocab_size)  # raises on an inconsistent vocab before any work
    d2t_path, t2d_path = vocab_paths(vocab_dir)
    rows = _check_tokenized(version) if online or window else _check_inputs(version)  # window: rows not stored
    save_path = out_dir / "checkpoints"
    _move_incomplete_checkpoints(save_path, log)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_resume_spec(out_dir, save_path, {
        "target": target.model, "aux_layer_ids": aux, "draft_layers": cfg.draft_layers,
        "d2t_sha256": sha256_file(d2t_path), "t2d_sha256": sha256_file(t2d_path)})
    log(f"train: {rows} rows, aux layers {aux} (+ final {dims.num_layers}), draft vocab "
        f"{d2t_path.name}, device {cfg.device} x {cfg.world_size} process(es), attention {cfg.attention}, "
        f"{cfg.epochs} epochs -> {save_path}")
    job = TrainJob(mode="train", train=cfg, target=target, tokenized_dir=version.tokenized_dir,
                   hidden_states_dir=str(version.hidden_states_dir),
                   d2t_path=str(d2t_path.resolve()), t2d_path=str(t2d_path.resolve()), aux_layer_ids=aux,
                   out_dir=str(out_dir.resolve()), save_path=str(save_path.resolve()),
                   metrics_path=str((out_dir / "metrics.jsonl").resolve()),
                   result_path=str((out_dir / "train_result.json").resolve()),
                   init_from=previous.checkpoint if previous is not None else None,
                   # the evaluate stage's baseline, written by the same child (stages.stage_evaluate finds it there)
                   untrained_dir=str((out_dir / UNTRAINED_DIR).resolve()),
                   window=window, online=None if online is None else online.model_copy(
                       update={"cache_dir": str((out_dir / "online" / "no_stored_rows").resolve())}))
    out = _run_worker(job, out_dir / "train_job.json", log, out_dir / "train.log", cfg.timeout_s)
    fit_, res = out.pop("fit", None), TrainOutput.model_validate(out)
    best = Path(res.checkpoint_best)
    checked = Path(target.model).is_dir()
    if checked:  # the exported draft must be the one we meant before anything serves it
        export_check(best, vocab_dir, Path(target.model))
        log(f"train: export check passed for {best} (-> epoch {res.checkpoint_best_epoch}): d2t/t2d equal "
            f"{d2t_path.name}/{t2d_path.name}, shapes, verifier embeddings and lm_head rows")
    else:
        log(f"train: export check skipped: target {target.model} is not a local directory")
    result = TrainResult(
        world_size=res.world_size, steps=res.steps, final_loss=res.final_loss, first_loss=res.first_loss,
        val_loss=res.val_loss, final_acc=res.final_acc, tokens_per_s=res.tokens_per_s, tokens=res.tokens,
        epochs_done=res.epochs_done, resumed_from_epoch=res.resumed_from_epoch,
        checkpoint_best=best, checkpoint_last=Path(res.checkpoint_last),
        metrics=Path(res.metrics), export_checked=checked, dir=str(out_dir.resolve()),
        init="previous" if previous is not None else "scratch",
        previous_draft=previous.checkpoint if previous is not None else None,
        previous_version=f"{previous.prepare_version}/{previous.extract_version}" if previous is not None else None,
        engine_start_s=res.startup_s, mode="online" if online else "window" if window else "offline",
        cached=res.resumed_from_epoch + 1 >= res.epochs_done, resumed_from_step=res.resumed_from_step,
        checkpoint_every_steps=cfg.checkpoint_every_steps, fit=fit_,
        **topology(cfg).model_dump(include={"nodes", "ranks_per_node", "accumulation_steps", "global_batch_tokens",
                                                  "sharding"}))
    write_json(out_dir / RECORD_NAME, result.model_dump(mode="json"))
    return result


def make_untrained_draft(target: TargetConfig, version: ExtractVersion, vocab_dir: Path, out_dir: Path,
                         cfg: TrainConfig, *, log: Callable[[str], None] = print,
                         timeout_s: float = 1800.0) -> Path:
    """Write a randomly initialised draft (same architecture and vocab as `train_draft` would train;
    verifier embeddings / lm_head rows copied) to `out_dir`, replacing it atomically. Returns out_dir."""
    out_dir = Path(out_dir)
    aux = version.aux_layer_ids
    load_vocab(vocab_dir, version.dims.vocab_size)
    d2t_path, t2d_path = vocab_paths(vocab_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-") as tmp:
        staging = Path(tmp) / "draft"
        job = TrainJob(mode="untrained", train=cfg, target=target, d2t_path=str(d2t_path.resolve()),
                       t2d_path=str(t2d_path.resolve()), aux_layer_ids=aux, out_dir=str(staging),
                       result_path=str(Path(tmp) / "result.json"))
        _run_worker(job, Path(tmp) / "job.json", log, None, timeout_s, distributed=False)  # one process writes it
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    log(f"train: untrained draft written to {out_dir}")
    return out_dir


# Train settings that change how a run is watched, not the draft it produces: a new value resumes
# the same checkpoint dir instead of training from scratch.
TRAIN_KEY_EXCLUDE = frozenset({"log_freq", "timeout_s", "num_workers", "online_start_timeout_s", "online_request_timeout_s",
                               "checkpoint_every_steps", "rdzv_port", "rdzv_timeout_s", "estimate_after_steps",
                               # the topology: the key names the global batch it gives instead (train_key)
                               "nodes", "global_batch_tokens"})


def train_key(cfg: PipelineConfig, version: ExtractVersion) -> str:
    """Keyed by the data, the vocab and the train settings; with `train.init: previous` (and a previous
    draft to continue from) also by that draft (lineage.previous_draft)."""
    vocab_dir = version.vocab_dir(cfg.vocab.draft_vocab_size).resolve()
    prev = previous_for(cfg, version)
    train = cfg.train.model_dump(exclude=set(TRAIN_KEY_EXCLUDE) | ({"init", "refresh_epochs"} if prev is None else set())
                                 | ({"mode"} if cfg.train.mode == "offline" else set())  # offline keys as before
                                 | ({"window_shards", "window_bytes"} if cfg.train.mode != "window" else set()))
    train["fsdp"] = train.pop("sharding") == "fsdp"  # its spelling before the choice: the keys from before
    t = cfg.train
    if t.batch_tokens != t.world_size * t.max_seq_len:  # one node's one row per rank: the keys from before nodes
        train["global_batch_tokens"] = t.batch_tokens
    return content_key({"extract": version.content_key, "vocab": str(vocab_dir), "train": train,
                        **({"previous": prev.checkpoint} if prev else {})})


def previous_for(cfg: PipelineConfig, version: ExtractVersion) -> PreviousDraft | None:
    """The previous version's draft this training continues from (train.init: previous), or None."""
    return previous_draft(version) if cfg.train.init == "previous" else None


def train_start(cfg: PipelineConfig, version: ExtractVersion, log: Log) -> tuple[PreviousDraft | None, TrainConfig]:
    """(the previous draft to continue from or None, the train settings for it), said in the log."""
    prev = previous_for(cfg, version)
    if cfg.train.init == "previous" and prev is None:
        log("train: train.init=previous but no other version of this dataset/model/layers has a trained draft; "
            "training from scratch")
    tcfg = cfg.train if prev is None else cfg.train.model_copy(update={"epochs": cfg.train.refresh_epochs})
    if prev is not None:
        log(f"train: continuing from the draft of version {prev.prepare_version}/{prev.extract_version} "
            f"({prev.checkpoint}) for {tcfg.epochs} epoch(s)")
    return prev, tcfg


class TrainInputs(BaseModel):
    version: ExtractVersion  # the verified records (offline) or the data a server makes them from (online)
    voc: VocabResult  # the draft vocabulary


def run(cfg: PipelineConfig, inputs: TrainInputs, log: Log) -> TrainResult:
    """The stage's entry (StageSpec.run), offline: the stored records, into `version.train_dir(train_key)` (keyed by
    all that shapes the draft: the same inputs reuse the checkpoint, an interrupted run resumes). Online training
    is pipeline/online_training.py (a verify gate on the server's rows first)."""
    version = inputs.version
    prev, tcfg = train_start(cfg, version, log)
    return train_draft(tcfg, cfg.target, version, Path(inputs.voc.dir), version.train_dir(train_key(cfg, version)),
                       log=log, previous=prev)


RETRY = Retry(2, 60, (*IO, *CHILD),
              "trainer child (crash, OOM kill, lost node, timeout); a retry resumes from the last complete epoch "
              "checkpoint in the same train dir, so it does only the unfinished epochs; never on a failed export "
              "check (a gate)")
STAGE = StageSpec(name="train", run=run, result=TrainResult, failure=ContractError,
                  worker="eagle3_pipeline.train.worker", accelerators=True, own_job=True, retry=RETRY)
