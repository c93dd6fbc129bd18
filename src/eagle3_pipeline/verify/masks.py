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
from eagle3_pipeline.verify.check import Check, Verdict


def prepared_hashes(tokenized_dir) -> dict[int, str] | None:
    """{row: hash} prepare recorded when it judged the rows (None: a prepare version without them)."""
    path = Path(tokenized_dir).parent / ROW_HASHES
    if not path.is_file():
        return None
    from safetensors.numpy import load_file

    return {i: bytes(h).hex() for i, h in enumerate(load_file(str(path))["hashes"])}


class RowMasks(Check):
    """Each row of `ds` (the tokenized dataset) that has a hash, against extraction's hashes (of the published
    `shards`: shardrun.ShardEntry) and `prepared` (prepared_hashes)."""
    name = "masks"

    def __init__(self, ds, shards: list, prepared: dict[int, str] | None = None):
        self.ds, self.prepared = ds, prepared or {}
        self.hashes = {int(r): h for e in shards if e.status == "published" for r, h in e.row_hashes.items()}

    def admits(self, r: int) -> bool:
        return (r in self.hashes or r in self.prepared) and r < len(self.ds)

    def unable(self, items: list[int]) -> str | None:
        return None if items else "no row hashes in the manifest (extracted before they were kept)"

    def verdict(self, items: list[int]) -> Verdict:
        ds, prepared, hashes = self.ds, self.prepared, self.hashes
        sub = ds.select(items).with_format("numpy", columns=["input_ids", "loss_mask"])
        sids = ds.select(items)["sample_id"] if "sample_id" in ds.column_names else [None] * len(items)
        flags = {}
        for r, rec, sid in zip(items, sub, sids):
            now = row_hash(rec["input_ids"], rec["loss_mask"])
            if r in prepared and now != prepared[r]:
                flags[r] = [f"{record_name(r)} (row {r}, sample {sid}): the tokenized row train would read is not the "
                            f"one prepare judged (hash {prepared[r]} at prepare, {now} now): the tokenized dataset "
                            f"changed after prepare (a shifted mask, reordered or replaced rows); remove the prepare "
                            f"version's directory to prepare it again"]
            elif r in hashes and now != hashes[r]:
                flags[r] = [f"{record_name(r)} (row {r}, sample {sid}): the prepared row's tokens or loss mask are not "
                            f"those it was extracted from (hash {hashes[r]} at extraction, {now} now): the tokenized "
                            f"dataset changed after extraction (a shifted mask, reordered or replaced rows)"]
        return Verdict(flags)


def mask_problems(ds, shards: list, rows: list[int], prepared: dict[int, str] | None = None
                  ) -> tuple[list[str], list[int], int]:
    """(problems, bad rows, rows compared) of `rows` (RowMasks)."""
    out = RowMasks(ds, shards, prepared).run(rows)
    return [p for r in out.flags for p in out.flags[r]], list(out.flags), out.result.records
