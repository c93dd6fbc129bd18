"""train/window_sampler.py: the trainer's sampler over the capture window. Capture runs as its own process writing
real hidden-state records into a window of 2 shards; the sampler packs (speculators' packing sampler) and shuffles
within the shards it holds, a simulated trainer checkpoints where a pass ends and releases what the checkpoint
covers. Checked: the store never held more than the window, every row is read once per pass, a batch never mixes
blocks, packing stays within the token budget, and a trainer that never checkpoints stalls with a message that
says why instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from eagle3_pipeline.train.window import ShardWindow, WindowError, WindowStalled
from eagle3_pipeline.train.window_sampler import WindowSampler, pack, rows_per_pass, shard_rows

SHARDS, ROWS = 5, 7  # 35 rows, shard s holds rows 7s .. 7s+6
LENGTHS = [5 + (7 * r) % 23 for r in range(SHARDS * ROWS)]  # 5 .. 27 tokens
MAX_LEN = 64

CAPTURE = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from eagle3_pipeline.records.contracts import HS_KEY, TOKENS_KEY, record_name
    from eagle3_pipeline.train.window import ShardWindow
    root, passes, shards, rows = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lengths, window = [int(x) for x in sys.argv[5].split(",")], int(sys.argv[6])
    w = ShardWindow(root, max_shards=window, passes=passes)
    for s in range(shards):
        key = f"shard-{s:03d}"
        w.reserve(key, 1, wait_s=600, poll_s=0.01)
        d = w.shard_dir(key)
        d.mkdir(parents=True)
        nbytes = 0
        for r in range(s * rows, (s + 1) * rows):
            t = lengths[r]
            save_file({TOKENS_KEY: torch.arange(t, dtype=torch.int64),
                       HS_KEY: torch.randn(t, 2, 8).to(torch.bfloat16)}, str(d / record_name(r)))
            nbytes += (d / record_name(r)).stat().st_size
        w.publish(key, nbytes)
    w.close()
""")


def _capture(root, passes: int, window: int = 2) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", CAPTURE, str(root), str(passes), str(SHARDS), str(ROWS),
                             ",".join(map(str, LENGTHS)), str(window)], env=env)


@pytest.mark.parametrize("passes", [1, 2])
def test_capture_process_and_windowed_trainer(tmp_path, passes):
    cap = _capture(tmp_path, passes)
    w = ShardWindow(tmp_path, max_shards=2, passes=passes)
    s = WindowSampler(w, LENGTHS, MAX_LEN, seed=3, wait_s=600)
    batches, held, checkpoints = [], [], 0
    try:
        for b in s:  # the "trainer": a step per batch, a step checkpoint wherever a pass ended
            batches.append(b)
            st = w.state()
            held.append(len(st.shards))
            if s.due(len(batches)):
                s.covered(len(batches))
                checkpoints += 1
    finally:
        assert cap.wait(600) == 0
    st = w.state()
    assert st.peak_shards <= 2 and max(held) <= 2 and st.shards == {}
    assert (st.published, st.released) == (SHARDS, SHARDS) and not any((tmp_path / "shards").iterdir())
    assert rows_per_pass(batches) == {r: passes for r in range(SHARDS * ROWS)}  # every row, once per pass
    assert all(sum(LENGTHS[r] for r in b) <= MAX_LEN for b in batches)
    assert checkpoints == len(s.blocks_read) * passes and s.read == [f"shard-{i:03d}" for i in range(SHARDS)]
    # a batch holds rows of one block (shards read together), and a block's passes all come before the next block
    block_of = {r: k for k, keys in enumerate(s.blocks_read) for key in keys for r in _rows(key)}
    assert all(len({block_of[r] for r in b.tolist()}) == 1 for b in batches)
    order = [block_of[int(b[0])] for b in batches]
    assert order == sorted(order)


def _rows(key: str) -> range:
    i = int(key.split("-")[1])
    return range(i * ROWS, (i + 1) * ROWS)


def test_a_trainer_that_never_checkpoints_stalls_saying_why(tmp_path):
    w = ShardWindow(tmp_path, max_shards=2)
    for i in range(2):
        key = f"shard-{i:03d}"
        w.reserve(key, 1, wait_s=0)
        w.shard_dir(key).mkdir(parents=True)
        for r in _rows(key):
            (w.shard_dir(key) / f"hs_{r}.safetensors").write_bytes(b"")
        w.publish(key, 1)
    s = WindowSampler(w, LENGTHS, MAX_LEN, wait_s=0.0)
    it = iter(s)
    got = [next(it) for _ in range(len(pack(np.asarray(LENGTHS), list(range(2 * ROWS)), MAX_LEN, seed=0)))]
    assert s.due(len(got)) and w.try_reserve("shard-002", 1) is False  # read, not covered: capture has no room
    with pytest.raises(WindowStalled, match="no step checkpoint covers them, so capture cannot put more in"):
        next(it)


def test_shard_rows_and_bad_input(tmp_path):
    w = ShardWindow(tmp_path, max_shards=2)
    w.shard_dir("a").mkdir(parents=True)
    with pytest.raises(WindowError, match="no row records"):
        shard_rows(w, "a")
    for name in ("hs_10.safetensors", "hs_2.safetensors", "notes.txt", "hs_3.safetensors.tmp"):
        (w.shard_dir("a") / name).write_bytes(b"")
    assert shard_rows(w, "a") == [2, 10]
    with pytest.raises(WindowError, match="is not a directory"):
        shard_rows(w, "missing")
    with pytest.raises(WindowError, match="1 token or more"):
        WindowSampler(w, LENGTHS, 0)


def test_pack_is_speculators_packing_over_the_rows_given():
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = np.asarray(LENGTHS)
    rows = list(range(7, 21))
    mine = pack(lengths, rows, MAX_LEN, seed=5)
    theirs = list(MultipackDistributedBatchSamplerV2(MAX_LEN, lengths[rows], num_replicas=1, rank=0, seed=5))
    assert [m.tolist() for m in mine] == [[rows[i] for i in t] for t in theirs]
    assert sorted(r for m in mine for r in m.tolist()) == rows


def test_rows_are_packed_and_shuffled_across_the_shards_the_window_holds(tmp_path):
    """Two shards published before the trainer reads: one block, whose batches mix rows of both shards (the
    shuffle is within the window, not within a shard), in another order each pass."""
    w = ShardWindow(tmp_path, max_shards=2, passes=2)
    for i in range(2):
        key = f"shard-{i:03d}"
        w.reserve(key, 1, wait_s=0)
        w.shard_dir(key).mkdir(parents=True)
        for r in _rows(key):
            (w.shard_dir(key) / f"hs_{r}.safetensors").write_bytes(b"")
        w.publish(key, 1)
    w.close()
    s = WindowSampler(w, LENGTHS, MAX_LEN, seed=1, wait_s=0.0)
    batches, ends = [], []
    for b in s:
        batches.append(b.tolist())
        if s.due(len(batches)):
            s.covered(len(batches))
            ends.append(len(batches))
    assert len(ends) == 2 and ends[1] == len(batches) and s.blocks_read == [["shard-000", "shard-001"]] and w.state().released == 2
    assert any({r // ROWS for r in b} == {0, 1} for b in batches)
    first, second = batches[: ends[0]], batches[ends[0]:]
    assert sorted(r for b in first for r in b) == sorted(r for b in second for r in b) == list(range(2 * ROWS))
    assert first != second


PLAN = [(f"shard-{i:03d}", list(_rows(f"shard-{i:03d}"))) for i in range(SHARDS)]


@pytest.mark.parametrize("passes", [1, 2])
def test_with_a_plan_blocks_are_half_the_window_and_the_length_is_known(tmp_path, passes):
    """A window of 4: blocks of 2 shards in capture order (the trainer reads one half while capture writes the
    other), so the sampler's length (what speculators sizes its schedule by) is the batches it then yields."""
    cap = _capture(tmp_path, passes, window=4)
    w = ShardWindow(tmp_path, max_shards=4, passes=passes)
    s = WindowSampler(w, LENGTHS, MAX_LEN, seed=7, wait_s=600, plan=PLAN)
    expected = len(s)
    batches = []
    try:
        for b in s:
            batches.append(b)
            if s.due(len(batches)):
                s.covered(len(batches))
    finally:
        assert cap.wait(600) == 0
    assert len(batches) == expected
    assert s.blocks_read == [["shard-000", "shard-001"], ["shard-002", "shard-003"], ["shard-004"]]
    assert rows_per_pass(batches) == {r: passes for r in range(SHARDS * ROWS)}
    assert w.state().peak_shards <= 4 and w.state().shards == {}
    s.set_epoch(0)
    with pytest.raises(WindowError, match="one epoch over the stream"):
        s.set_epoch(1)


def test_a_shard_against_the_plan_is_an_error(tmp_path):
    w = ShardWindow(tmp_path, max_shards=2)
    with pytest.raises(WindowError, match="once"):
        WindowSampler(w, LENGTHS, MAX_LEN, plan=PLAN + PLAN[:1])
    with pytest.raises(WindowError, match="no length"):
        len(WindowSampler(w, LENGTHS, MAX_LEN))
    for key in ("shard-001", "shard-000"):  # published out of the plan's order
        w.reserve(key, 1, wait_s=0)
        w.shard_dir(key).mkdir(parents=True)
        for r in _rows(key):
            (w.shard_dir(key) / f"hs_{r}.safetensors").write_bytes(b"")
        w.publish(key, 1)
    with pytest.raises(WindowError, match=r"published \['shard-001'\] where the plan has \['shard-000'\]"):
        next(iter(WindowSampler(w, LENGTHS, MAX_LEN, wait_s=0.0, plan=PLAN)))
    swapped = [("shard-001", PLAN[0][1]), ("shard-000", PLAN[1][1])] + PLAN[2:]
    with pytest.raises(WindowError, match="shard-001 holds rows \\[7, 8"):
        next(iter(WindowSampler(w, LENGTHS, MAX_LEN, wait_s=0.0, plan=swapped)))


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_the_dataset_reads_a_row_from_whichever_shard_holds_it(tmp_path, storage):
    """window_transfer: speculators' dataset reads `hs_<row>` from the window's shard dirs, fp8 dequantized like
    offline (hs_connectors' FP8Transfer on the stored dir gives the same tensors); a released row is missing."""
    import torch
    from hs_connectors.transfer import FP8Transfer
    from safetensors.torch import save_file

    from eagle3_pipeline.records.contracts import HS_KEY, TOKENS_KEY, record_name, to_record
    from eagle3_pipeline.train.window_sampler import window_transfer

    w, flat = ShardWindow(tmp_path / "w", max_shards=2), tmp_path / "flat"
    flat.mkdir()
    for i in range(2):
        key = f"shard-{i:03d}"
        w.reserve(key, 1, wait_s=0)
        w.shard_dir(key).mkdir(parents=True)
        for r in _rows(key):
            rec = to_record(torch.randn(LENGTHS[r], 2, 8), torch.arange(LENGTHS[r]), storage)
            save_file(rec, str(w.shard_dir(key) / record_name(r)))
            save_file(rec, str(flat / record_name(r)))
        w.publish(key, 1)
    t, offline = window_transfer(w), FP8Transfer(flat, torch.bfloat16)
    for r in (0, 6, 7, 13):
        got, want = t.get_cached(r), offline.get_cached(r)
        assert set(got) == {HS_KEY, TOKENS_KEY} and got[HS_KEY].dtype == torch.bfloat16
        assert torch.equal(got[HS_KEY], want[HS_KEY]) and torch.equal(got[TOKENS_KEY], want[TOKENS_KEY])
    assert t.get_cached(14) is None  # no shard holds row 14
    w.consume("shard-000")
    assert t.get_cached(0) is None and t.get_cached(7) is not None


def test_speculators_loader_trains_from_the_window(tmp_path):
    """The real data path of the trainer: speculators' train loader (its ArrowDataset over a tokenized dataset, its
    collate) with `window_transfer` and a `WindowSampler` over the train split's rows as its batch sampler. Every
    packed batch holds the rows the sampler chose, with their tokens and no row dropped, and the window empties."""
    import datasets
    import torch
    from safetensors.torch import save_file
    from speculators.train.dataloader import create_train_val_loaders
    from torch.utils.data import DataLoader

    from eagle3_pipeline.records.contracts import record_name, to_record
    from eagle3_pipeline.train.window_sampler import window_transfer

    tokens = [list(range(100 + r, 100 + r + n)) for r, n in enumerate(LENGTHS)]
    datasets.Dataset.from_dict({"input_ids": tokens, "loss_mask": [[1] * n for n in LENGTHS],
                                "seq_len": LENGTHS}).with_format("torch").save_to_disk(str(tmp_path / "tok"))
    w = ShardWindow(tmp_path / "w", max_shards=4)
    train_plan = PLAN[:4]  # rows 0-27: speculators' train split at 0.8 (rows 28-34 validate; not in the window)
    for key, rows in train_plan:
        w.reserve(key, 1, wait_s=0)
        w.shard_dir(key).mkdir(parents=True)
        for r in rows:
            rec = to_record(torch.randn(LENGTHS[r], 3, 8), torch.tensor(tokens[r]), "bf16")
            save_file(rec, str(w.shard_dir(key) / record_name(r)))
        w.publish(key, 1)
    w.close()
    train, _ = create_train_val_loaders(
        data_path=str(tmp_path / "tok"), total_seq_len=MAX_LEN, hidden_states_dtype=torch.float32,
        transfer=window_transfer(w), vllm_endpoint="", on_missing="raise", verifier_name_or_path="unused",
        request_timeout=None, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=8, num_target_layers=2, num_workers=0, prefetch_factor=None, preprocess=None,
        train_data_ratio=0.8)
    assert len(train.dataset) == 28
    class Recording(WindowSampler):  # the batch of rows the loader collated last (no workers: one at a time)
        def __iter__(self):
            for b in super().__iter__():
                self.last = b.tolist()
                yield b

    sampler = Recording(w, LENGTHS[:28], MAX_LEN, seed=2, wait_s=0.0, plan=train_plan)
    loader = DataLoader(train.dataset, batch_sampler=sampler, collate_fn=train.collate_fn, num_workers=0)
    assert len(loader) == len(sampler)
    seen, n = [], 0
    for batch in loader:
        n += 1
        rows = sampler.last
        used = sum(LENGTHS[r] for r in rows)  # the packed rows, then padding to MAX_LEN
        assert batch["input_ids"].flatten().tolist()[:used] == [t for r in rows for t in tokens[r]]
        assert batch["position_ids"].flatten().tolist()[:used] == [i for r in rows for i in range(LENGTHS[r])]
        assert tuple(batch["hidden_states"].shape) == (1, MAX_LEN, 2 * 8) and float(batch["error_records"]) == 0
        seen += rows
        if sampler.due(n):
            sampler.covered(n)
    assert n == len(loader) and sorted(seen) == list(range(28)) and w.ready() is None
