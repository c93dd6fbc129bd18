"""Child process of the train stage: `python -m eagle3_pipeline.train.worker JOB.json`.

How it works, what it reads and writes, its test hooks: docs/internals.md, `train/worker.py`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import psutil

from eagle3_pipeline.core import heap
from eagle3_pipeline.core.config import TrainConfig
from eagle3_pipeline.core.faults import take_fault
from eagle3_pipeline.core.proc import emit_event
from eagle3_pipeline.core.store import write_json
from eagle3_pipeline.train.accumulate import STAGING_PREFIX, Accumulator, GroupedLoader, put_in_place
from eagle3_pipeline.train.job import TrainJob, TrainOutput, UntrainedOutput
from eagle3_pipeline.train.window import ShardWindow
from eagle3_pipeline.train.window_sampler import WindowSampler, window_transfer

# what a fork server imports before forking this worker (core/forkserver.py): torch.distributed and speculators
FORK_PRELOAD = ("torch.distributed", "torch.optim._muon", "datasets", "safetensors.torch", "speculators.models.eagle3",
                "speculators.models.eagle3.data", "speculators.train.checkpointer", "speculators.train.cli",
                "speculators.train.dataloader", "speculators.train.distributed", "speculators.train.trainer")

ATTN_IMPL = {"sdpa": "sdpa", "eager": "eager", "flex_attention": "simple_flex_attention"}
KILL_ENV = "EAGLE3_TRAIN_KILL_AT"
STEP_DELAY_ENV = "EAGLE3_TEST_STEP_DELAY_S"
# speculators' step profiler phases (ms), kept per step in metrics.jsonl: where a step's time went
# (fetch = waiting for the data loader, incl. the previous step's logging)
PHASES = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms")
log = logging.getLogger("eagle3_pipeline.train.worker")


def _kill_self(why: str) -> None:
    log.warning("%s: SIGKILL (injected fault, %s)", why, KILL_ENV)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _parse_kill(spec: str | None) -> tuple[str, int, int] | None:
    """KILL_ENV -> ("step" | "term", epoch, n) | ("save", epoch, 0) | None."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        if parts[0] in ("step", "term") and len(parts) == 3:
            return parts[0], int(parts[1]), int(parts[2])
        if parts[0] == "save" and len(parts) == 2:
            return "save", int(parts[1]), 0
    except ValueError:
        pass
    raise ValueError(f"{KILL_ENV}={spec!r}: expected 'step:<epoch>:<n>', 'term:<epoch>:<n>' or 'save:<epoch>'")


def _is_rank0() -> bool:
    from speculators.train.distributed import get_rank

    return get_rank() == 0


def _install_cpu_shim() -> None:
    """Let speculators' single-process trainer run without an accelerator (see module docstring)."""
    import speculators.train.checkpointer as ckpt
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None  # the step timer calls it around every phase
    ckpt.get_current_device = lambda: "cpu"  # resume: load model/optimizer state onto the cpu


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles): elsewhere oneDNN/ATen
    emulate it, a bf16 matmul costing ~25x an fp32 one on an AVX2 core (a tiny draft's step: 2.8 s)."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(getattr(torch.cpu, name)() for name in probes if hasattr(torch.cpu, name))
    except Exception:  # noqa: BLE001 - a probe that fails: no native bf16 assumed
        return False


def compute_dtype(cfg: TrainConfig):
    """train.compute_dtype resolved: the trainer's autocast dtype and the dtype of the hidden states in its
    batches. auto: bfloat16 on cuda and on CPUs with native bf16, float32 on other CPUs."""
    import torch

    name = cfg.compute_dtype
    if name == "auto":
        name = "bfloat16" if cfg.device != "cpu" or native_bf16_cpu() else "float32"
    return getattr(torch, name)


def muon_in_fp32() -> bool:
    """Run Muon's Newton-Schulz orthogonalisation in fp32 instead of torch's hard-coded bf16 (in
    `torch.optim._muon._zeropower_via_newtonschulz`): on a CPU without native bf16 those matmuls are
    emulated and cost more than the backward pass (docs/training.md, "Compute dtype"). The same
    quintic iteration with the same coefficients, only more precise. Returns whether it was installed
    (False where this torch has no such function: nothing to change)."""
    import torch
    import torch.optim._muon as muon

    original = getattr(muon, "_zeropower_via_newtonschulz", None)
    if original is None or getattr(original, "eagle3_fp32", False):
        return original is not None

    def zeropower_fp32(grad, ns_coefficients, ns_steps, eps):
        if grad.ndim != 2:
            return original(grad, ns_coefficients, ns_steps, eps)  # its own error
        a, b, c = ns_coefficients
        x = grad.float()
        tall = x.size(0) > x.size(1)
        if tall:
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x

    zeropower_fp32.eagle3_fp32 = True
    muon._zeropower_via_newtonschulz = zeropower_fp32
    return True


def _setup_cpu_distributed() -> None:
    """Under torchrun on CPU: what speculators' `maybe_setup_distributed` does on GPUs (a process group,
    then its topology state and SP/DP groups), with the gloo backend (it asks for an accelerator).
    Each rank gets its own share of the cores (threads and affinity). Without torchrun: nothing."""
    if "LOCAL_RANK" not in os.environ:
        return
    import speculators.train.distributed as sd
    import torch
    import torch.distributed as dist

    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // local_world)
    mine = cores[(local_rank * per_rank) % len(cores):][:per_rank] or cores[:1]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    dist.init_process_group("gloo")
    sd._local_rank, sd._is_distributed = local_rank, True
    sd._rank, sd._world_size = dist.get_rank(), dist.get_world_size()
    sd._init_sp_process_groups(sd._rank, sd._world_size, 1)
    log.info("rank %d of %d (gloo on cpu), cores %s", sd._rank, sd._world_size, mine)


def _setup_logging() -> None:
    h = logging.StreamHandler(sys.stdout)
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: ranks other than 0 log warnings only
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{f' [rank {rank}]' if rank else ''}: %(message)s",
                            "%H:%M:%S")
    h.setFormatter(fmt)
    for name in ("speculators", "eagle3_pipeline"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        lg.addHandler(h)
        lg.propagate = False


class _MetricSink(logging.Handler):
    """Receives the dicts speculators' Trainer logs to `speculators.metrics`; writes metrics.jsonl
    and forwards each record to the parent as an event."""

    def __init__(self, path: Path, ttt_steps: int, kill: tuple[str, int, int] | None = None, last_epoch: int = 0,
                 accumulation: int = 1):
        super().__init__(logging.INFO)
        self.last_epoch = last_epoch  # faults.take_fault("train") kills after the first step of this epoch
        from speculators.train.distributed import get_world_size

        self.world_size = get_world_size() * accumulation  # packed rows per optimizer step
        self.path = Path(path)
        self.ttt_steps = ttt_steps
        self.last_train: dict | None = None
        self.kill = kill if kill and kill[0] in ("step", "term") else None
        self.steps_in_kill_epoch = 0

    def _per_step(self, m: dict, key: str, suffix: str = "") -> list[float | None]:
        return [m.get(f"{key}_{k}{suffix}") for k in range(self.ttt_steps)]

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict):
            return
        if "train" in msg:
            m, prof = msg["train"], msg.get("profile") or {}
            step_s = prof.get("step_ms", 0.0) / 1000.0
            # speculators profiles rank 0's own (last) packed row; every row of a step holds ~the same token
            # count (its multipack sampler), so the step's tokens are that times the rows per step
            tokens = round(prof.get("tokens_per_s", 0.0) * step_s * self.world_size)
            lr = msg.get("lr")
            line = {"kind": "train_step", "step": msg.get("global_step"), "epoch": msg.get("epoch"),
                    "loss": m.get("loss"), "loss_per_step": self._per_step(m, "loss"),
                    "acc": self._per_step(m, "full_acc"), "cond_acc": self._per_step(m, "cond_acc"),
                    "lr": lr if not isinstance(lr, dict) else lr.get("AdamW", next(iter(lr.values()))),
                    "tokens": tokens, "step_s": step_s,
                    "tokens_per_s": tokens / step_s if step_s > 0 else prof.get("tokens_per_s"),
                    "error_records": m.get("error_records"),
                    **{k: prof.get(k) for k in PHASES}}
            self.last_train = line
        elif "val" in msg:
            m = msg["val"]
            line = {"kind": "val", "epoch": msg.get("epoch"), "loss": m.get("loss_epoch"),
                    "loss_per_step": self._per_step(m, "loss", "_epoch"),
                    "acc": self._per_step(m, "full_acc", "_epoch"), "cond_acc": self._per_step(m, "cond_acc", "_epoch")}
        else:
            return
        line = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in line.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        emit_event(**line)
        if line["kind"] == "train_step" and (delay := float(os.environ.get(STEP_DELAY_ENV, "0") or 0)):
            time.sleep(delay)  # test hook (STEP_DELAY_ENV)
        if line["kind"] == "train_step" and line["epoch"] == self.last_epoch and take_fault("train"):
            _kill_self(f"after step {line['step']} (first of the last epoch, {line['epoch']}; EAGLE3_TEST_FAIL_ONCE)")
        if self.kill and line["kind"] == "train_step" and line["epoch"] == self.kill[1]:
            self.steps_in_kill_epoch += 1
            if self.steps_in_kill_epoch >= self.kill[2]:
                where = f"after step {line['step']} (step {self.steps_in_kill_epoch} of epoch {line['epoch']})"
                if self.kill[0] == "term":
                    self.kill = None
                    log.warning("%s: SIGTERM (injected fault, %s)", where, KILL_ENV)
                    os.kill(os.getpid(), signal.SIGTERM)  # speculators' handler raises from here
                else:
                    _kill_self(where)


def _trim_metrics(path: Path, global_step: int, epoch: int) -> None:
    """On resume, drop metric lines from steps the checkpoint does not contain (they are replayed)."""
    if not path.exists():
        return
    keep = []
    for raw in path.read_text().splitlines():
        try:
            d = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if (d.get("kind") == "train_step" and d.get("step", 0) < global_step) or \
           (d.get("kind") == "val" and d.get("epoch", 0) < epoch):
            keep.append(raw)
    path.write_text("".join(k + "\n" for k in keep))


def _summarise(path: Path) -> dict:
    """Totals over metrics.jsonl (all attempts): steps, first/final loss, tokens, tokens/s."""
    steps = []
    vals = []
    if path.exists():
        for raw in path.read_text().splitlines():
            d = json.loads(raw)
            (steps if d["kind"] == "train_step" else vals).append(d)
    tokens = sum(d.get("tokens") or 0 for d in steps)
    secs = sum(d.get("step_s") or 0.0 for d in steps)
    return {"logged_steps": len(steps), "first_loss": steps[0]["loss"] if steps else None,
            "final_loss": steps[-1]["loss"] if steps else None,
            "final_acc": steps[-1]["acc"] if steps else None,
            "val_loss": vals[-1]["loss"] if vals else None, "val_acc": vals[-1]["acc"] if vals else None,
            "tokens": tokens, "train_seconds": secs, "tokens_per_s": tokens / secs if secs > 0 else 0.0}


def build_draft(job: TrainJob):
    """speculators' Eagle3DraftModel for the target, as `speculators train` builds it by default
    (llama decoder, norm_before_fc, norm_output, norm_before_residual), except that every draft layer
    uses full attention (classic EAGLE-3; vLLM then serves it without sliding-window layers)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    cfg, target = job.train, job.target
    d2t_path, t2d_path = job.d2t_path, job.t2d_path
    d2t = torch.from_numpy(np.load(d2t_path, allow_pickle=False))  # [K] offsets
    t2d = torch.from_numpy(np.load(t2d_path, allow_pickle=False))  # [V] bool
    n = cfg.draft_layers
    tl_config = create_transformer_layer_config(
        verifier_name_or_path=target.model, num_layers=n, draft_arch="llama", hidden_act="silu",
        sliding_window=cfg.max_seq_len, full_attention_indices=list(range(n)),
        trust_remote_code=target.trust_remote_code)
    return Eagle3DraftModel.from_training_args(
        verifier_config=tl_config, t2d=t2d, d2t=d2t, verifier_name_or_path=target.model,
        trust_remote_code=target.trust_remote_code, target_layer_ids=job.aux_layer_ids,
        draft_vocab_size=int(d2t.shape[0]), norm_before_residual=True, norm_before_fc=True, fc_norm=False,
        norm_output=True, embed_requires_grad=False, ttt_steps=cfg.ttt_steps,
        draft_attn_impl=ATTN_IMPL[cfg.attention])


def init_from_draft(model, checkpoint: Path) -> dict:
    """Initialise `model` from a previous version's draft checkpoint (train.init: previous). Every
    tensor of the same name and shape is copied, except the draft vocab maps (d2t/t2d: the new
    version's); the draft lm_head's rows are matched by target token id (row i predicts target token
    i + d2t[i]), so a token that kept its place in the draft vocab keeps its row even when the vocab
    moved; rows of tokens new to the draft vocab keep their fresh initialisation. A resumed checkpoint
    of this training (speculators' resume) still overrides all of it. Returns counts for the log."""
    import torch
    from safetensors.torch import load_file

    prev = load_file(str(Path(checkpoint) / "model.safetensors"))
    state = model.state_dict()
    copied, remapped, skipped = 0, 0, []
    old_t = new_t = None
    if "d2t" in prev and "d2t" in state:
        old_t = torch.arange(prev["d2t"].shape[0]) + prev["d2t"].long()
        new_t = torch.arange(state["d2t"].shape[0]) + state["d2t"].long()
    with torch.no_grad():
        for name, t in state.items():
            if name in ("d2t", "t2d") or name not in prev:
                continue
            src = prev[name]
            if "lm_head" in name and old_t is not None and src.shape[0] == old_t.shape[0] and t.shape[1:] == src.shape[1:]:
                where = {int(tok): i for i, tok in enumerate(old_t.tolist())}
                pairs = [(j, where[int(tok)]) for j, tok in enumerate(new_t.tolist()) if int(tok) in where]
                if pairs:
                    dst_idx, src_idx = map(torch.tensor, zip(*pairs))
                    t[dst_idx] = src[src_idx].to(t.dtype)
                remapped += len(pairs)
            elif tuple(src.shape) == tuple(t.shape):
                t.copy_(src.to(t.dtype))
                copied += 1
            else:
                skipped.append(name)
    print(f"train worker: initialised from {checkpoint}: {copied} tensors copied, {remapped} lm_head rows "
          f"matched by target token, skipped {skipped}", flush=True)
    return {"copied": copied, "remapped": remapped, "skipped": skipped}


def _loaders(job: TrainJob, hidden_size: int, num_aux: int):
    """speculators' own train/val loaders (`create_train_val_loaders`, what `speculators train` uses):
    its ArrowDataset over our tokenized rows + hs files, split by row index (the last val_ratio of
    the rows for validation), packed into rows of max_seq_len tokens by its multipack sampler.
    Offline, a row without its hidden-state file raises; online (job.online), every row is generated
    on demand by the stage's vLLM server (speculators' on_missing=generate) and its file deleted once read.
    Files are read through hs_connectors' FP8Transfer: bf16 files pass unchanged, fp8 files
    (extract.storage_dtype=fp8: + hidden_states_scales) are dequantized to bf16 per token."""
    import torch
    from datasets import load_from_disk
    from hs_connectors.transfer import FP8Transfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    cfg = job.train
    n_rows = len(load_from_disk(job.tokenized_dir))
    n_train = int(n_rows * (1 - cfg.val_ratio))
    if n_train < 1 or n_rows - n_train < 1:
        raise ValueError(f"{job.tokenized_dir}: {n_rows} rows cannot be split into train and validation "
                         f"with train.val_ratio={cfg.val_ratio} (each needs at least one row)")
    on = job.online
    if on:  # every row from the server: an empty directory of stored rows, so each one is generated
        Path(on.cache_dir).mkdir(parents=True, exist_ok=True)
        from eagle3_pipeline.train.online_data import ServerFileTransfer  # noqa: PLC0415  heavy: torch, speculators (train/online_data.py)

        transfer = ServerFileTransfer(Path(on.cache_dir), on.request_timeout_s, len(job.aux_layer_ids) + 1,
                                      on.hidden_size)
        source = dict(transfer=transfer, vllm_endpoint=on.endpoint,
                      on_missing="generate", request_timeout=on.request_timeout_s, max_retries=2,
                      generation_validation_retries=2, max_consecutive_generation_failures=5)
    else:
        source = dict(transfer=FP8Transfer(Path(job.hidden_states_dir), torch.bfloat16), vllm_endpoint="",
                      on_missing="raise", request_timeout=None, max_retries=0, generation_validation_retries=0,
                      max_consecutive_generation_failures=1)
    loaders = create_train_val_loaders(
        data_path=job.tokenized_dir, total_seq_len=cfg.max_seq_len, hidden_states_dtype=compute_dtype(cfg),
        verifier_name_or_path=job.target.model, **source, hidden_size=hidden_size,
        num_target_layers=num_aux, num_workers=cfg.num_workers, prefetch_factor=4, preprocess=shift_batch,
        train_data_ratio=1 - cfg.val_ratio, seed=cfg.seed)
    if job.window:
        loaders = _window_loaders(job, loaders)
    if on:  # the rows of a packed batch are requested at once (train/online_data.py)
        from eagle3_pipeline.train.online_data import ConcurrentArrowDataset  # noqa: PLC0415  heavy: torch, speculators (train/online_data.py)

        for loader in loaders:
            loader.dataset.__class__ = ConcurrentArrowDataset
            loader.dataset.max_in_flight = int(on.max_in_flight)
            loader.dataset.checks_spec = on.checks  # every row judged against the target (online_data.RowChecks)
    return loaders


def _window_loaders(job: TrainJob, loaders):
    """job.window: the train rows from the capture window as it fills, packed within its blocks
    (train/window_sampler.py), through speculators' own dataset and collate; validation rows from the stored dir.
    No loader workers: a worker's prefetch could wait on a release that needs the step it holds back."""
    import torch
    from hs_connectors.transfer import FP8Transfer
    from torch.utils.data import DataLoader


    win, cfg = job.window, job.train
    if cfg.accumulation_steps != 1 or cfg.epochs != 1 or cfg.world_size != 1:
        raise ValueError("train from a window: one process, accumulation_steps 1 and epochs 1 (the window's passes "
                         f"are its epochs); asked world_size {cfg.world_size}, accumulation_steps "
                         f"{cfg.accumulation_steps}, epochs {cfg.epochs}")
    train, val = loaders
    w = ShardWindow(Path(win.dir), win.max_shards, win.max_bytes, win.passes)
    lengths = [int(x) for x in train.dataset.data["seq_len"]]
    planned = sorted(r for _, rows in win.plan for r in rows)
    if planned != list(range(len(train.dataset))):
        raise ValueError(f"the window plan holds {len(planned)} rows; speculators' train split has "
                         f"{len(train.dataset)} (rows 0..{len(train.dataset) - 1}): plan the train split, once each")
    train.dataset.transfer = window_transfer(w, torch.bfloat16)
    val.dataset.transfer = FP8Transfer(Path(job.hidden_states_dir), torch.bfloat16)
    sampler = WindowSampler(w, lengths, cfg.max_seq_len, seed=cfg.seed, wait_s=win.wait_s, plan=win.plan)
    return DataLoader(train.dataset, batch_sampler=sampler, collate_fn=train.collate_fn, num_workers=0), val


def _install_save_kill(trainer, epoch: int) -> None:
    """KILL_ENV=save:<epoch>: die after that epoch's weights/optimizer are written, before its
    training_state.json (the last file speculators writes for a checkpoint)."""
    orig = trainer._save_training_state

    def save_training_state(ep: int, local_step: int) -> None:
        if ep == epoch:
            _kill_self(f"while saving the checkpoint of epoch {ep}")
        orig(ep, local_step)

    trainer._save_training_state = save_training_state


def run_train(job: TrainJob) -> TrainOutput | None:
    import torch
    from speculators.train.cli import set_seed

    cfg = job.train
    kill = _parse_kill(os.environ.get(KILL_ENV))
    save_path = Path(job.save_path)
    metrics_path = Path(job.metrics_path)
    set_seed(cfg.seed)
    model = build_draft(job)
    if job.init_from:
        init_from_draft(model, Path(job.init_from))
    hidden_size = model.config.transformer_layer_config.hidden_size
    train_loader, val_loader = _loaders(job, hidden_size, len(job.aux_layer_ids))
    train_loader = _accumulating(cfg, model, train_loader)
    trainer, dtype = _trainer(job, model, train_loader, val_loader)
    if kill and kill[0] == "save":
        _install_save_kill(trainer, kill[1])
    resumed_from, resumed_step = trainer.checkpointer.previous_epoch, trainer.global_step
    rank0 = _is_rank0()
    startup_s = round(time.time() - _process_started(), 2)  # imports, draft, loaders, trainer: before step 1
    if rank0:
        _trim_metrics(metrics_path, trainer.global_step, trainer.current_epoch)
        emit_event(kind="start", startup_s=startup_s, resumed_from_epoch=resumed_from, global_step=trainer.global_step,
                   epochs=cfg.epochs, train_batches_per_epoch=len(train_loader),
                   val_batches=len(val_loader), threads=torch.get_num_threads(), compute_dtype=str(dtype).removeprefix("torch."),
                   params_trainable=sum(
                       p.numel() for p in model.parameters() if p.requires_grad))
    mlog = logging.getLogger("speculators.metrics")
    mlog.setLevel(logging.INFO)
    mlog.propagate = False
    if rank0:
        mlog.addHandler(_MetricSink(metrics_path, cfg.ttt_steps, kill, cfg.epochs - 1, cfg.accumulation_steps))
    t0 = time.time()
    trainer.run_training()
    wall = time.time() - t0
    if not rank0:  # every rank has passed speculators' final barrier; rank 0 reports
        return None

    best, last = _checkpoints(trainer, save_path)
    summary = _summarise(metrics_path)
    if job.untrained_dir:
        _write_untrained_once(job)
    from speculators.train.distributed import get_world_size

    return TrainOutput(steps=trainer.global_step, world_size=get_world_size(), epochs_done=last + 1,
                       resumed_from_epoch=resumed_from, resumed_from_step=resumed_step, checkpoint_best=str(best),
                       checkpoint_best_epoch=int(os.readlink(best)), checkpoint_last=str(save_path / str(last)),
                       metrics=str(metrics_path), wall_seconds_this_attempt=wall, startup_s=startup_s, **summary)


def _trainer(job: TrainJob, model, train_loader, val_loader):
    """(speculators' Trainer for the job, a CPU one where the device is the CPU; the compute dtype)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.trainer import TrainerConfig

    cfg = job.train
    cpu = cfg.device == "cpu"
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=cfg.loss, loss_implementation="eager" if cpu else "fused",
        ttt_steps=cfg.ttt_steps, ttt_step_loss_decay=cfg.ttt_step_loss_decay)

    trainer_cls = trainer_class(cfg)
    dtype = compute_dtype(cfg)
    if dtype == torch.float32:  # autocast to fp32 is plain fp32: torch warns that it disables itself, every step
        warnings.filterwarnings("ignore", message=".*[Aa]utocast.*")
        muon_in_fp32()
    trainer = trainer_cls(model, TrainerConfig(
        lr=cfg.lr, num_epochs=cfg.epochs, save_path=str(Path(job.save_path)), resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, optimizer=cfg.optimizer,
        muon_lr=cfg.lr, checkpoint_freq=1, save_best=False, hidden_states_dtype=dtype,
        log_freq=cfg.log_freq, fsdp_shard=cfg.sharding == "fsdp", gradient_checkpointing=cfg.gradient_checkpointing,
        max_steps=cfg.max_steps), train_loader, val_loader)
    return trainer, dtype


def _checkpoints(trainer, save_path: Path) -> tuple[Path, int]:
    """(checkpoint_best, the last epoch) once training has returned: an interrupted run or one without an
    epoch checkpoint fails; where validation recorded no best, checkpoint_best is the last epoch."""
    if (save_path / "interrupted").is_dir():  # speculators caught SIGTERM/SIGINT, saved this, and returned
        raise RuntimeError(f"training was interrupted by a signal at step {trainer.global_step}; its partial save "
                           f"{save_path / 'interrupted'} is not resumed from (the next attempt resumes from the last "
                           f"epoch checkpoint)")
    best = save_path / "checkpoint_best"
    last = type(trainer.checkpointer)(save_path).previous_epoch  # speculators' own scan of <epoch>/ dirs
    if last < 0:
        raise RuntimeError(f"{save_path}: training finished without writing any epoch checkpoint")
    if not best.exists():  # no validation improvement recorded (e.g. NaN val loss): use the last epoch
        if best.is_symlink():
            best.unlink()
        best.symlink_to(str(last), target_is_directory=True)
    return best, last


def _accumulating(cfg: TrainConfig, model, train_loader):
    """train.accumulation_steps > 1: A packed rows per rank per optimizer step (train/accumulate.py)."""
    if cfg.accumulation_steps == 1:
        return train_loader
    from speculators.train.distributed import get_dp_rank, get_dp_size


    Accumulator(model, cfg.accumulation_steps)
    return GroupedLoader(train_loader, get_dp_rank(), get_dp_size(), cfg.accumulation_steps)


def trainer_class(cfg: TrainConfig):
    """speculators' Trainer with: the CPU as its device; no zero_grad of its own under accumulation (accumulate.py);
    step checkpoints (every train.checkpoint_every_steps steps; where a window pass ends: `_release`), every save then
    written beside its place and renamed into it (accumulate.put_in_place): never an epoch dir half-overwritten."""
    import torch
    import torch.distributed as dist
    from speculators.train.trainer import Trainer


    cpu, accumulation, every, max_steps = cfg.device == "cpu", cfg.accumulation_steps, cfg.checkpoint_every_steps, \
        cfg.max_steps

    class PipelineTrainer(Trainer):
        def setup_model(self):
            if cpu:
                self.local_rank = torch.device("cpu")  # type: ignore[assignment]
                self.device_type = "cpu"
            super().setup_model()

        def _optimizers_zero_grad(self):
            if accumulation == 1:
                super()._optimizers_zero_grad()

        def train_epoch(self, epoch, *, step_callback=None):
            self.train_loader.batch_sampler.set_epoch(epoch)
            steps = len(self.train_loader)  # the whole epoch's (before a resume's fast-skip shortens it)
            done = [getattr(self, "_resume_local_step", 0) if epoch == self.current_epoch else 0]
            window = _window_of(self, resumed_at=done[0])

            def after_step():
                done[0] += 1
                if window is not None and window.due(done[0]):  # a pass over a block ended: checkpoint, release
                    _release(self, window, epoch, done[0])
                elif every and self.global_step % every == 0 and done[0] < steps and \
                        not (max_steps and self.global_step >= max_steps):
                    self.maybe_save_checkpoint(epoch, local_step=done[0])
                if step_callback is not None:
                    step_callback()

            super().train_epoch(epoch, step_callback=after_step)

        def maybe_save_checkpoint(self, epoch, local_step: int = 0):
            # in place, as speculators writes it, where each epoch directory is written once (no step checkpoints:
            # the parent moves an incomplete one aside), and for its "interrupted" save of a stopped attempt
            if not (every or _window_of(self)) or not isinstance(epoch, int):
                return super().maybe_save_checkpoint(epoch, local_step)
            root = self.checkpointer.path
            staging = root / f"{STAGING_PREFIX}{epoch}-{self.global_step}"
            self.checkpointer.path = staging
            try:
                super().maybe_save_checkpoint(epoch, local_step)
            finally:
                self.checkpointer.path = root
            if self.rank == 0 and (staging / str(epoch)).is_dir():
                put_in_place(root, staging, epoch)
            if self.is_distributed:
                dist.barrier()

    return PipelineTrainer


def _window_of(trainer, resumed_at: int = 0):
    """The train loader's WindowSampler (job.window), or None; a window run resumed within its epoch is refused."""
    bs = getattr(trainer.train_loader, "batch_sampler", None)
    if not hasattr(bs, "covered"):
        return None
    if resumed_at:
        raise RuntimeError(f"resuming a window run at step {resumed_at} is not built: the shards it released are "
                           "gone from the window (docs/decisions/capture-window.md)")
    return bs


def _release(trainer, window, epoch: int, batches: int) -> None:
    """A pass over a window block ended at `batches`: a step checkpoint, then its shards consumed (rank 0)."""
    trainer.maybe_save_checkpoint(epoch, local_step=batches)
    if trainer.rank == 0:
        window.covered(batches)


def _process_started() -> float:
    return psutil.Process().create_time()


def _write_untrained_once(job: TrainJob) -> None:
    """The evaluate stage's baseline (`run_untrained`) into job.untrained_dir unless it is there,
    written by this child, whose imports are paid already (a child of its own would pay them again).
    The parent holds the train dir's lock, which evaluate takes before it looks for the baseline."""
    out = Path(job.untrained_dir)
    if (out / "config.json").exists():
        return
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    run_untrained(job.model_copy(update={"out_dir": str(staging)}))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def run_untrained(job: TrainJob) -> UntrainedOutput:
    """A randomly initialised draft (verifier embeddings / lm_head rows / norm copied as in training),
    saved in bf16 exactly like speculators' `--dry-run`."""
    import torch
    from speculators.train.checkpointer import patch_config_dtype
    from speculators.train.cli import set_seed

    set_seed(job.train.seed)
    model = build_draft(job)
    model.to(torch.bfloat16)
    out = Path(job.out_dir)
    model.save_pretrained(out)
    patch_config_dtype(out / "config.json", torch.bfloat16)
    return UntrainedOutput(checkpoint=str(out))


MODES = {"train": run_train, "untrained": run_untrained}


def main(argv: list[str]) -> int:
    heap.tune()  # before the imports main makes
    if len(argv) != 2:
        print("usage: python -m eagle3_pipeline.train.worker JOB.json", file=sys.stderr)
        return 2
    job = TrainJob.model_validate_json(Path(argv[1]).read_text())
    _setup_logging()
    from speculators.train.distributed import maybe_destroy_distributed, maybe_setup_distributed

    if job.train.device == "cpu":
        _install_cpu_shim()
        warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true but no accelerator")
        _setup_cpu_distributed()
    else:
        maybe_setup_distributed()  # under torchrun: NCCL on the GPU of LOCAL_RANK
    try:
        result = MODES[job.mode](job)
        if _is_rank0():
            data = result.model_dump(mode="json")
            write_json(Path(job.result_path), data)
            emit_event(kind="done", **{k: v for k, v in data.items() if not isinstance(v, dict)})
    finally:
        maybe_destroy_distributed()
    return 0


if __name__ == "__main__":
    from eagle3_pipeline.core.proc import exit_child

    exit_child(main(sys.argv))  # result and checkpoints are written: skip torch's teardown
