"""ExtractVersions for tests that run the stage cores on a directory of their own.

The pipeline builds its one `layout.ExtractVersion` with `plan_extract(cfg, prep, pre)`; tests of
extract, verify and train often start from a tokenized dataset (or a cut of one) and an output
directory instead. `make_version` builds the same record from those, with the dims and default
layer ids of the target (`contracts.model_dims`, `contracts.resolve_layer_ids`); `relocated` moves
an existing version to another directory (and optionally another tokenized dataset); `extract_all`
publishes every group of a version and summarises it (what `stages.stage_extract` does with a
PipelineConfig). Reads the tokenized dataset's row count and the target's config.json; writes nothing.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.core.config import ExtractConfig, TargetConfig
from eagle3_pipeline.records.layout import ExtractVersion, plan_shards


def _rows(tokenized_dir: Path) -> int:
    import datasets  # lazy: metadata only

    return datasets.load_from_disk(str(tokenized_dir)).num_rows


def make_version(target: TargetConfig, tokenized_dir: Path, out_dir: Path, *, content_key: str,
                 rows_per_shard: int, layer_ids: list[int] | None = None, storage_dtype: str = "bf16",
                 shards_per_group: int | None = None, prepare_version: str = "test") -> ExtractVersion:
    """The ExtractVersion of `tokenized_dir` extracted into `out_dir` (all shards in one group unless
    `shards_per_group`); `layer_ids` default to the target's aux ids + N."""
    from eagle3_pipeline.records.contracts import model_dims, resolve_layer_ids

    dims = model_dims(target)
    ids = list(layer_ids) if layer_ids is not None else resolve_layer_ids(dims.num_layers, None)
    rows = _rows(Path(tokenized_dir))
    shards = plan_shards(rows, rows_per_shard)
    k = [s.index for s in shards]
    per = shards_per_group or max(1, len(k))
    return ExtractVersion(content_key=content_key, dir=str(Path(out_dir).resolve()), prepare_version=prepare_version,
                          tokenized_dir=str(Path(tokenized_dir).resolve()), layer_ids=ids, dims=dims,
                          storage_dtype=storage_dtype, rows=rows, rows_per_shard=rows_per_shard, shards=shards,
                          groups=[k[i:i + per] for i in range(0, len(k), per)])


def relocated(version: ExtractVersion, out_dir: Path, *, tokenized_dir: Path | None = None,
              content_key: str | None = None) -> ExtractVersion:
    """`version` in another directory (same shard plan unless another tokenized dataset is given: then
    its rows, in one shard group of `rows_per_shard` rows), without the record pool: the copy extracts
    for real instead of linking what `version`'s own run put in the pool."""
    update: dict = {"dir": str(Path(out_dir).resolve()), "pool_dir": None}  # a fresh extraction, not the pool's
    if content_key is not None:
        update["content_key"] = content_key
    if tokenized_dir is not None:
        rows = _rows(Path(tokenized_dir))
        shards = plan_shards(rows, version.rows_per_shard)
        update.update(tokenized_dir=str(Path(tokenized_dir).resolve()), rows=rows, shards=shards,
                      groups=[[s.index for s in shards]])
    return version.model_copy(update=update)


def extract_all(cfg: ExtractConfig, target: TargetConfig, version: ExtractVersion, *, log, force: bool = False):
    """Every group of `version`, one engine child each, then its ExtractResult (from the manifest)."""
    from eagle3_pipeline.extract.stage import extract_group, summarize

    for group in version.groups:
        extract_group(cfg, target, version, group, log=log, force=force)
    return summarize(version.path)
