"""Every record against the prepared row it was extracted from: token ids and loss mask.

Reads the extract manifest's `row_hashes` (per shard: contracts.row_hash of each extracted row, taken
by the extract child from the tokenized dataset it read) and the tokenized dataset as the trainer will
read it. A row whose hash differs was changed after extraction (a shifted loss mask, rows reordered or
replaced): its record no longer belongs to it. Rows linked from the record pool get theirs when they
are linked (extract/stage.py `_row_hashes`); rows extracted before hashes were kept have none and are
counted, not judged.
"""

from __future__ import annotations

from eagle3_pipeline.records.contracts import record_name, row_hash


def mask_problems(ds, shards: list, rows: list[int]) -> tuple[list[str], list[int], int]:
    """(problems, bad rows, rows compared) for `rows` of the tokenized dataset `ds` (`shards`: shardrun.ShardEntry)."""
    hashes = {int(r): h for e in shards if e.status == "published" for r, h in e.row_hashes.items()}
    todo = [r for r in rows if r in hashes and r < len(ds)]
    if not todo:
        return [], [], 0
    sub = ds.select(todo).with_format("numpy", columns=["input_ids", "loss_mask"])
    sids = ds.select(todo)["sample_id"] if "sample_id" in ds.column_names else [None] * len(todo)
    problems, bad = [], []
    for r, rec, sid in zip(todo, sub, sids):
        now = row_hash(rec["input_ids"], rec["loss_mask"])
        if now != hashes[r]:
            bad.append(r)
            problems.append(f"{record_name(r)} (row {r}, sample {sid}): the prepared row's tokens or loss mask are not "
                            f"those it was extracted from (hash {hashes[r]} at extraction, {now} now): the tokenized "
                            f"dataset changed after extraction (a shifted mask, reordered or replaced rows)")
    return problems, bad, len(todo)
