"""Gradient accumulation and step checkpoints for speculators' trainer (imported by the train child only).

More: docs/internals.md, "train/accumulate.py".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MICRO_KEY = "eagle3_micro_batches"  # the earlier micro-batches of a step (no "__" prefix: speculators' recovery
#                                     refuses unconsumed keys of that form)
RECOVERY_KEY = "__recovery__"       # speculators.train.recovery.RECOVERY_METADATA_KEY


class GroupSampler:
    """Per optimizer step, this rank's A packed rows; the fast-skip interface speculators' resume uses
    (`_generate_batches`, `_cached_generated_batches`) and `set_epoch`, over groups."""

    def __init__(self, base, rank: int, ranks: int, accumulation: int):
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

        self.parts = [MultipackDistributedBatchSamplerV2(
            batch_max_length=base.batch_max_length, lengths=base.lengths, num_replicas=ranks * accumulation,
            rank=rank * accumulation + a, seed=base.seed) for a in range(accumulation)]
        self.epoch = 0
        self._cached_generated_batches: tuple[int, list] = (-1, [])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _generate_batches(self, epoch: int) -> list:
        if self._cached_generated_batches[0] == epoch:
            return self._cached_generated_batches[1]
        groups = [list(g) for g in zip(*(p._generate_batches(epoch) for p in self.parts))]
        self._cached_generated_batches = (epoch, groups)
        return groups

    def __iter__(self):
        return iter(self._generate_batches(self.epoch))

    def __len__(self) -> int:
        return len(self._generate_batches(self.epoch))


class _Flat:
    """The DataLoader's batch sampler: the groups' micro-batches one after another."""

    def __init__(self, groups: GroupSampler):
        self.groups = groups

    def __iter__(self):
        for group in self.groups._generate_batches(self.groups.epoch):
            yield from group

    def __len__(self) -> int:
        return len(self.groups) * len(self.groups.parts)


def _merge(micro: list[dict]) -> dict:
    """One step's batch: the last micro-batch, the earlier ones under MICRO_KEY, their recovery state merged."""
    from speculators.train.recovery import RecoveryMetadata

    metas = [m.pop(RECOVERY_KEY, None) for m in micro]
    metas = [m for m in metas if m is not None]
    out = dict(micro[-1])
    out["error_records"] = sum(int(m.get("error_records") or 0) for m in micro)
    out[MICRO_KEY] = micro[:-1]
    if metas:
        out[RECOVERY_KEY] = RecoveryMetadata(
            failure_count=sum(m.failure_count for m in metas), locally_empty=any(m.locally_empty for m in metas),
            fatal=any(m.fatal for m in metas), error=next((m.error for m in metas if m.error), ""))
    return out


class GroupedLoader:
    """What the trainer iterates: one dict per optimizer step (`_merge`); len() is the steps of an epoch."""

    def __init__(self, loader, rank: int, ranks: int, accumulation: int):
        from torch.utils.data import DataLoader

        self.accumulation = accumulation
        self.batch_sampler = GroupSampler(loader.batch_sampler, rank, ranks, accumulation)
        self.dataset = loader.dataset
        self.loader = DataLoader(
            loader.dataset, batch_sampler=_Flat(self.batch_sampler), num_workers=loader.num_workers,
            prefetch_factor=loader.prefetch_factor, pin_memory=loader.pin_memory, collate_fn=loader.collate_fn,
            persistent_workers=loader.persistent_workers, multiprocessing_context=loader.multiprocessing_context,
            worker_init_fn=loader.worker_init_fn)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        micro: list[dict] = []
        for batch in self.loader:
            micro.append(batch)
            if len(micro) == self.accumulation:
                yield _merge(micro)
                micro = []


class Accumulator:
    """Forward hooks on the draft: the pre-hook trains the step's earlier micro-batches, the post-hook scales
    the last one's loss by 1/A and adds their metrics (sum/total pairs) to its own."""

    def __init__(self, model, accumulation: int):
        self.accumulation = accumulation
        self.pending: dict | None = None
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True)

    def before(self, module, args, kwargs):
        import torch

        micro = kwargs.pop(MICRO_KEY, None)
        if micro is None:
            return None
        if not torch.is_grad_enabled():
            return args, kwargs
        module.zero_grad(set_to_none=True)  # the step starts here (the trainer's zero_grad is off, see above)
        device, sums = kwargs["hidden_states"].device, {}
        for batch in micro:
            moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            _, loss, metrics = module.forward(*args, **{**kwargs, **moved})
            (loss / self.accumulation).backward()
            for k, v in metrics.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
        self.pending = sums
        return args, kwargs

    def after(self, module, args, kwargs, output):
        if self.pending is None:
            return None
        draft_tokens, loss, metrics = output
        sums, self.pending = self.pending, None
        merged = {k: v + sums[k] if k in sums else v for k, v in metrics.items()}
        return draft_tokens, loss / self.accumulation, merged


# ------------------------------------------------------------------------------------- step checkpoints

STAGING_PREFIX = ".staging-"        # checkpoints/.staging-<epoch>-<step>/<epoch>/: a save being written
SUPERSEDED_PREFIX = ".superseded-"  # checkpoints/.superseded-<epoch>: the save it replaces, until it is in place


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(d: Path) -> None:
    """Every file of a save and its directory on disk before the rename that publishes it."""
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(d)


def put_in_place(root: Path, staging: Path, epoch: int) -> None:
    """Move a complete save `staging/<epoch>` to `root/<epoch>`, replacing a mid-epoch save of that epoch: renames
    only, so `root/<epoch>` is always one whole save (`recover` finishes a move a kill cut short)."""
    new, final, old = staging / str(epoch), root / str(epoch), root / f"{SUPERSEDED_PREFIX}{epoch}"
    _fsync_tree(new)
    if final.is_dir():
        final.rename(old)
    new.rename(final)
    for link in staging.iterdir():  # speculators' readable names (epoch0_step12 -> 0)
        if link.is_symlink():
            for stale in root.glob(f"epoch{epoch}_*"):
                if stale.is_symlink():
                    stale.unlink()
            (root / link.name).symlink_to(os.readlink(link))
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


def recover(root: Path, log) -> None:
    """Before a start: a save that never reached its place is dropped; a replaced save whose replacement was
    not yet in place is put back."""
    if not root.is_dir():
        return
    for d in sorted(root.iterdir()):
        if d.name.startswith(STAGING_PREFIX):
            log(f"train: {d.name} (a checkpoint save cut short) removed")
            shutil.rmtree(d, ignore_errors=True)
        elif d.name.startswith(SUPERSEDED_PREFIX):
            final = root / d.name.removeprefix(SUPERSEDED_PREFIX)
            if final.exists():
                shutil.rmtree(d, ignore_errors=True)
            else:
                log(f"train: {d.name} put back as {final.name} (its replacement never reached its place)")
                d.rename(final)
