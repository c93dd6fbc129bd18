"""The trainer's side of the capture window (train/window.py, docs/decisions/capture-window.md): a batch sampler
that packs and shuffles rows within the shards the window holds now, instead of over the whole dataset.

More: docs/internals.md, "train/window_sampler.py".
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence

import numpy as np

from eagle3_pipeline.train.window import ShardWindow, WindowError, WindowStalled

ROW_FILE = re.compile(r"^hs_(\d+)\.safetensors$")  # records/contracts.py record_name


def shard_rows(window: ShardWindow, key: str) -> list[int]:
    """The dataset rows whose records (`hs_<row>.safetensors`) shard `key` holds, in row order."""
    d = window.records_dir(key)
    if not d.is_dir():
        raise WindowError(f"shard {key} is published but {d} is not a directory")
    rows = sorted(int(m.group(1)) for p in d.iterdir() if (m := ROW_FILE.match(p.name)))
    if not rows:
        raise WindowError(f"shard {key} is published with no row records in {d}")
    return rows


def pack(lengths: np.ndarray, rows: Sequence[int], batch_max_length: int, seed: int,
         rank: int = 0, replicas: int = 1) -> list[np.ndarray]:
    """speculators' packing over `rows` only: its sampler on their lengths, its batches mapped back to rows."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    rows = np.asarray(rows, dtype=np.int64)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length, lengths[rows], num_replicas=replicas, rank=rank,
                                                 seed=seed)
    return [rows[b] for b in sampler]


class WindowSampler:
    def __init__(self, window: ShardWindow, lengths: Sequence[int], batch_max_length: int, *, seed: int = 0,
                 wait_s: float = 600.0, plan: Sequence[tuple[str, Sequence[int]]] | None = None):
        """Batches of dataset rows (`lengths[row]` tokens each) from `window`'s shards; `wait_s`: how long to
        wait for capture to publish a shard before WindowStalled. `plan`: the shards capture will publish, in
        order, with their rows. Without it a block is every published shard not read yet (at most the window);
        with it a block is the next `block_shards` of the plan (half the window: the trainer reads one half while
        capture writes the other), so the batches are known before they are read: `len()` (speculators sizes its
        LR schedule and epoch by it), and a shard that arrives out of order or with other rows is an error."""
        if batch_max_length < 1:
            raise WindowError(f"batch_max_length {batch_max_length}: a packed batch holds 1 token or more")
        st = window.state()
        self.block_shards = max(1, st.max_shards // 2) if plan is not None else None
        self.plan = None if plan is None else [(k, [int(r) for r in rows]) for k, rows in plan]
        if self.plan is not None and (not self.plan or len({k for k, _ in self.plan}) != len(self.plan)):
            raise WindowError(f"a window plan names every shard capture will publish, once ({len(self.plan)} given)")
        self.window, self.lengths, self.max_len = window, np.asarray(lengths, dtype=np.int64), int(batch_max_length)
        self.seed, self.wait_s = int(seed), float(wait_s)
        self.passes = st.passes
        self.read: list[str] = []                    # shards read (every pass), in the order read
        self.ends: list[tuple[int, list[str]]] = []  # (batches yielded when a pass ended, its shards), not covered
        self.batches = 0                             # batches yielded
        self.blocks_read: list[list[str]] = []       # the blocks, in the order read

    def due(self, batches: int) -> bool:
        """A pass ended at or before `batches` batches and is not covered by a checkpoint yet."""
        return bool(self.ends) and self.ends[0][0] <= batches

    def covered(self, batches: int) -> list[str]:
        """A step checkpoint holds the first `batches` batches: every pass that ended by then counts once for its
        shards (`ShardWindow.consume`). Returns the shards released now."""
        released = []
        while self.ends and self.ends[0][0] <= batches:
            _, keys = self.ends.pop(0)
            released += [k for k in keys if self.window.consume(k)]
        return released

    def _next_block(self) -> list[str] | None:
        """The published shards not read yet, oldest first; None once capture closed and every shard is read."""
        end = time.monotonic() + self.wait_s
        while True:
            keys = self.window.ready()
            if keys is None:
                return None
            new = [k for k in keys if k not in self.read]
            st = self.window.state()
            if new and self.plan is None:
                return new
            if new and (len(new) >= self.block_shards or st.closed):
                block = new[: self.block_shards]
                want = [k for k, _ in self.plan[len(self.read): len(self.read) + len(block)]]
                if block != want:
                    raise WindowError(f"the window at {self.window.dir} published {block} where the plan has {want}")
                return block
            if st.closed and not self.ends:
                return None  # every shard left is read and covered (released as its last pass was)
            if time.monotonic() >= end:
                stuck = self.ends and (st.closed or len(st.shards) >= st.max_shards)
                raise WindowStalled(
                    f"the window at {self.window.dir} had no new block for {self.wait_s:.0f}s ({len(st.shards)} of "
                    f"{st.max_shards} shards held, {len(new)} not read yet): " + (
                        "the trainer read them and no step checkpoint covers them, so capture cannot put more in: "
                        "checkpoint where `due` says a pass ended, then `covered`" if stuck else
                        "capture published nothing"))
            time.sleep(0.2)

    def _pass_batches(self, rows: list[int], block: int, p: int) -> list[np.ndarray]:
        return pack(self.lengths, rows, self.max_len, seed=self.seed + block * self.passes + p)

    def __len__(self) -> int:
        """The batches of the whole run (every block, every pass), packed from the plan as they will be read."""
        if self.plan is None:
            raise WindowError("a window sampler without a plan has no length: its blocks are what capture publishes")
        n, step = 0, self.block_shards
        for b, i in enumerate(range(0, len(self.plan), step)):
            rows = [r for _, rs in self.plan[i: i + step] for r in rs]
            n += sum(len(self._pass_batches(rows, b, p)) for p in range(self.passes))
        return n

    def set_epoch(self, epoch: int) -> None:
        """speculators calls it each epoch; a window is read once (its passes are per block): one epoch."""
        if epoch > 0:
            raise WindowError("train.mode window trains one epoch over the stream; its passes are per block")

    def _rows(self, key: str) -> list[int]:
        rows = shard_rows(self.window, key)
        if self.plan is not None and rows != (want := dict(self.plan)[key]):
            raise WindowError(f"shard {key} holds rows {rows[:5]}... ({len(rows)}); the plan has {want[:5]}... "
                              f"({len(want)})")
        return rows

    def __iter__(self) -> Iterator[np.ndarray]:
        while (block := self._next_block()) is not None:
            rows = [r for k in block for r in self._rows(k)]
            for p in range(self.passes):
                batches = self._pass_batches(rows, len(self.blocks_read), p)
                if not batches:
                    raise WindowError(f"shards {block}: their {len(rows)} rows packed into no batch")
                for i, batch in enumerate(batches):
                    self.batches += 1
                    if i == len(batches) - 1:  # before the last batch goes: its step may checkpoint (`due`)
                        self.ends.append((self.batches, list(block)))
                    yield batch
            self.read += block
            self.blocks_read.append(list(block))


def rows_per_pass(batches: list[np.ndarray]) -> dict[int, int]:
    """{row: how many batches held it} (a check for tests and the report: every row once per pass)."""
    out: dict[int, int] = {}
    for b in batches:
        for r in b.tolist():
            out[r] = out.get(r, 0) + 1
    return out




def window_transfer(window: ShardWindow, dtype=None):
    """hs_connectors' FP8Transfer for speculators' dataset, finding `hs_<row>` in whichever shard of `window` holds
    it (at most the window's shards to look in) instead of one hidden-states dir; fp8 records are dequantized as
    offline. A row in no shard (released, or not published yet) reads as missing: the dataset's `on_missing`."""
    import torch
    from hs_connectors.transfer import FP8Transfer

    class WindowTransfer(FP8Transfer):
        def get_cached(self, file_idx: int):
            shards = window.dir / "shards"
            for d in sorted(shards.iterdir()) if shards.is_dir() else []:
                p = d / f"hs_{int(file_idx)}.safetensors"
                if not p.is_file():
                    p = d / "hidden_states" / p.name  # a shard captured as an extract version dir
                if p.is_file():
                    return self.get_generated({"hidden_states_path": str(p)})
            return None

    return WindowTransfer(window.dir / "shards", dtype or torch.bfloat16)
