"""The one typed record of an extraction: `ExtractVersion`.

More: docs/internals.md, "records/layout.py".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core.store import content_key, extract_key, model_fingerprint, slug, within
from eagle3_pipeline.records.contracts import ModelDims, fingerprint_name, record_name
from eagle3_pipeline.records.pool import pool_key, pool_location
from eagle3_pipeline.records.shardrun import MANIFEST_NAME, ShardRun

FINGERPRINTS_DIR = "fingerprints"


class Shard(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    row_start: int  # inclusive
    row_end: int    # exclusive


def plan_shards(num_rows: int, rows_per_shard: int) -> list[Shard]:
    """Contiguous row ranges of `rows_per_shard` rows (the last may be shorter)."""
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    n = math.ceil(num_rows / rows_per_shard)
    return [Shard(index=k, row_start=k * rows_per_shard, row_end=min(num_rows, (k + 1) * rows_per_shard))
            for k in range(n)]


class ExtractVersion(BaseModel):
    """Everything that identifies and locates one extraction (frozen: built once, passed around)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    content_key: str
    dir: str                    # absolute path of the version directory
    prepare_version: str
    tokenized_dir: str          # absolute path of the tokenized dataset it extracts
    layer_ids: list[int]        # captured ids: aux ids ascending, then N
    dims: ModelDims
    storage_dtype: Literal["bf16", "fp8"] = "bf16"
    rows: int
    rows_per_shard: int
    shards: list[Shard]
    groups: list[list[int]]     # shard ids per engine child (one model load each)
    pool_dir: str | None = None  # the record pool its records are linked from/into (pool.py)

    # -- layer ids
    @property
    def aux_layer_ids(self) -> list[int]:
        """The draft's inputs: captured ids without the final layer N."""
        return self.layer_ids[:-1]

    # -- paths
    @property
    def path(self) -> Path:
        return Path(self.dir)

    @property
    def hidden_states_dir(self) -> Path:
        return self.path / "hidden_states"

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_NAME

    @property
    def verify_path(self) -> Path:
        return self.path / "verify.json"

    def record_path(self, row: int) -> Path:
        return self.hidden_states_dir / record_name(row)

    @property
    def fingerprints_dir(self) -> Path:
        return self.path / FINGERPRINTS_DIR

    def fingerprint_path(self, row: int) -> Path:
        return self.fingerprints_dir / fingerprint_name(row)

    def vocab_dir(self, draft_vocab_size: int) -> Path:
        return self.path / "vocab" / f"K{draft_vocab_size}"

    def train_dir(self, train_key: str) -> Path:
        return self.path / "train" / train_key

    # -- shards
    def shard(self, index: int) -> Shard:
        return self.shards[index]

    def group_cache_key(self, shard_ids: list[int]) -> str:
        """Cache key of one shard group: the content key, the directory and the shards' row ranges."""
        return content_key({"extract": self.content_key, "dir": self.dir, "shards": list(shard_ids),
                            "ranges": [[self.shards[k].row_start, self.shards[k].row_end] for k in shard_ids]})

    def unpublished(self, shard_ids: list[int]) -> list[int]:
        """Shards of `shard_ids` that the manifest does not list as published for this plan's row
        ranges (all of them when there is no manifest). Prefect's cache may only answer a group none
        of whose shards is here: a shard that verify marked failed, or a wiped store, runs again."""
        ranges = {s.index: [s.row_start, s.row_end] for s in self.shards}
        done = {s.index for s in ShardRun(self.path).read(missing_ok=True).published()
                if [s.row_start, s.row_end] == ranges.get(s.index)}
        return [k for k in shard_ids if k not in done]


def extract_location(prep, target, layer_ids: list[int], storage_dtype: str, connector: str,
                     engine: dict) -> tuple[str, Path]:
    """(content key, directory) of the extraction of one tokenized version (`prep`: its dir and version) by
    one target; `engine`: the engine settings that change a record's values (engine.cpu_build_kwargs())."""
    key = extract_key(prep.version, model_fingerprint(target.model, target.revision), layer_ids,
                      storage_dtype, connector, engine)
    return key, within(Path(prep.dir), slug(target.model), key)


def plan_extract(cfg, prep, pre, engine: dict) -> ExtractVersion:
    """The ExtractVersion of `cfg` (PipelineConfig) for a prepare record (PrepareResult) and a preflight
    record (PreflightResult: dims, layer ids and the storage dtype come from there, computed once); `engine`: the engine
    settings that change a record's values (stages.plan_extract passes engine.cpu_build_kwargs())."""
    import datasets  # lazy: arrow is memory-mapped, this reads only metadata

    e = cfg.extract
    key, out = extract_location(prep, cfg.target, pre.layer_ids, pre.storage_dtype,
                                f"{e.connector_module}.{e.connector_name}", engine)
    rows = datasets.load_from_disk(prep.tokenized).num_rows
    shards = plan_shards(rows, e.rows_per_shard)
    ids = [s.index for s in shards]
    per = e.shards_per_group or max(1, math.ceil(len(ids) / e.parallel_groups))  # one group per parallel slot
    pkey = pool_key(cfg.target, pre.layer_ids, pre.storage_dtype, f"{e.connector_module}.{e.connector_name}",
                    e.tensor_parallel_size, engine)
    pool = pool_location(Path(prep.dir).parent, cfg.target.model, pkey) if e.record_pool else None
    return ExtractVersion(content_key=key, dir=str(out.resolve()), prepare_version=prep.version,
                          pool_dir=str(pool.resolve()) if pool else None,
                          tokenized_dir=str(Path(prep.tokenized).resolve()), layer_ids=list(pre.layer_ids),
                          dims=pre.dims, storage_dtype=pre.storage_dtype, rows=rows, rows_per_shard=e.rows_per_shard,
                          shards=shards, groups=[ids[i:i + per] for i in range(0, len(ids), per)])
