"""Every row train will read against the row prepare judged, and every record against the row it was extracted from.

Reads prepare's `row_hashes.safetensors` (contracts.row_hash of each row as prepare built it and checked its mask
twice), the extract manifest's `row_hashes` (per shard: the hash of each extracted row, taken by the extract child
from the tokenized dataset it read) and the tokenized dataset as the trainer will read it. A row whose hash differs
from prepare's was changed after prepare (a shifted loss mask, rows reordered or replaced), whether before or after
extraction; one that differs from extraction's no longer belongs to its record. Rows linked from the record pool get
theirs when they are linked (extract/stage.py `_row_hashes`); versions without either hash are counted, not judged.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.data.tokenized import ROW_HASHES
from eagle3_pipeline.records.contracts import record_name, row_hash


def prepared_hashes(tokenized_dir) -> dict[int, str] | None:
    """{row: hash} prepare recorded when it judged the rows (None: a prepare version without them)."""
    path = Path(tokenized_dir).parent / ROW_HASHES
    if not path.is_file():
        return None
    from safetensors.numpy import load_file

    return {i: bytes(h).hex() for i, h in enumerate(load_file(str(path))["hashes"])}


def mask_problems(ds, shards: list, rows: list[int], prepared: dict[int, str] | None = None
                  ) -> tuple[list[str], list[int], int]:
    """(problems, bad rows, rows compared) for `rows` of the tokenized dataset `ds` (`shards`: shardrun.ShardEntry)
    against extraction's hashes and `prepared` (prepared_hashes)."""
    hashes = {int(r): h for e in shards if e.status == "published" for r, h in e.row_hashes.items()}
    todo = [r for r in rows if (r in hashes or (prepared and r in prepared)) and r < len(ds)]
    if not todo:
        return [], [], 0
    sub = ds.select(todo).with_format("numpy", columns=["input_ids", "loss_mask"])
    sids = ds.select(todo)["sample_id"] if "sample_id" in ds.column_names else [None] * len(todo)
    problems, bad = [], []
    for r, rec, sid in zip(todo, sub, sids):
        now = row_hash(rec["input_ids"], rec["loss_mask"])
        if prepared and r in prepared and now != prepared[r]:
            bad.append(r)
            problems.append(f"{record_name(r)} (row {r}, sample {sid}): the tokenized row train would read is not the "
                            f"one prepare judged (hash {prepared[r]} at prepare, {now} now): the tokenized dataset "
                            f"changed after prepare (a shifted mask, reordered or replaced rows); remove the prepare "
                            f"version's directory to prepare it again")
        elif r in hashes and now != hashes[r]:
            bad.append(r)
            problems.append(f"{record_name(r)} (row {r}, sample {sid}): the prepared row's tokens or loss mask are not "
                            f"those it was extracted from (hash {hashes[r]} at extraction, {now} now): the tokenized "
                            f"dataset changed after extraction (a shifted mask, reordered or replaced rows)")
    return problems, bad, len(todo)
