"""What the regenerate parent and its child share: the job file, the shard plan's numbering of input
rows, the input hash, and the names of the files a shard is published as. Light imports only (the
parent imports this; `python -m eagle3_pipeline.regenerate.worker` runs the child)."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core.config import EngineConfig, RegenerateConfig, SourceConfig, TargetConfig
from eagle3_pipeline.data.formats import raw_rows

ROWS_DIR = "rows"
QUARANTINE_DIR = "quarantine"


class ShardInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    row_start: int  # global input row index over all sources, in config order
    row_end: int
    input_sha: str  # sha256 of the shard's raw rows (input_sha below)


class RegenerateJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: TargetConfig
    engine: EngineConfig
    regenerate: RegenerateConfig
    template_kwargs: dict  # what the chat template gets besides messages and tools (thinking resolved)
    sources: list[SourceConfig]
    shards: list[ShardInput]
    out_dir: str
    attempt: int


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


def source_rows(sources: list[SourceConfig], token: str | None = None) -> Iterator[tuple[int, str, object]]:
    """(global row index, source format, RawRow) of every input row, sources in config order, each at
    most its `limit` rows: the numbering the shard plan uses."""
    n = 0
    for src in sources:
        for raw in raw_rows(src.path, src.limit, src.split, src.revision, token, src.on_damaged):
            yield n, src.format, raw
            n += 1


def input_sha(h, raw) -> None:
    """Add one raw row to a shard's input hash (its place and its bytes)."""
    h.update(f"{raw.source}|{raw.row}|{len(raw.blob)}|".encode())
    h.update(raw.blob)
