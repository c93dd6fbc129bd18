"""Input readers: every source row becomes a `Conversation` or a `Rejected` with its reason.

Owns format detection and normalisation of ShareGPT (`conversations`: `from`/`value`, roles
human/gpt/system), OpenAI (`messages`: `role`/`content`, system/tool turns, list-of-parts content)
and pre-tokenized (`input_ids` + `loss_mask`) rows. Reads local `.jsonl`/`.json`/`.parquet` files or
directories of them and `datasets.save_to_disk` directories. Nothing is dropped silently: a row that
cannot be read is yielded as `Rejected(source, row, reason, raw)` for the quarantine file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.errors import InputError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}
OPENAI_ROLES = {"system", "user", "assistant", "tool", "developer"}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class Conversation:
    sample_id: str
    messages: list[dict[str, str]]  # normalised: role in {system,user,assistant,tool}, content: str
    source: str
    row: int


@dataclass
class Pretokenized:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str
    row: int


@dataclass
class Rejected:
    source: str
    row: int
    reason: str
    raw: Any = field(default=None)


def detect_format(rec: dict) -> str | None:
    if "conversations" in rec:
        return "sharegpt"
    if "messages" in rec:
        return "openai"
    if "input_ids" in rec and "loss_mask" in rec:
        return "pretokenized"
    return None


def _content(c: Any) -> str:
    """OpenAI content: a string or a list of parts (`{"type": "text", "text": ...}`)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"unsupported content part {str(part)[:80]!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"content is {type(c).__name__}, expected a string or a list of text parts")


def normalise(rec: dict, fmt: str, source: str, row: int) -> Conversation | Pretokenized | Rejected:
    sample_id = str(rec.get("id", rec.get("sample_id", f"{Path(source).name}:{row}")))
    try:
        if fmt == "pretokenized":
            ids, mask = list(rec["input_ids"]), list(rec["loss_mask"])
            if len(ids) != len(mask):
                return Rejected(source, row, f"input_ids has {len(ids)} tokens, loss_mask {len(mask)}", rec)
            return Pretokenized(sample_id, [int(x) for x in ids], [int(x) for x in mask], source, row)
        turns = rec["conversations"] if fmt == "sharegpt" else rec["messages"]
        if not isinstance(turns, list) or not turns:
            return Rejected(source, row, "no turns", rec)
        msgs = []
        for j, t in enumerate(turns):
            if not isinstance(t, dict):
                return Rejected(source, row, f"turn {j} is not an object", rec)
            if fmt == "sharegpt":
                role_raw, content = t.get("from"), t.get("value")
                role = SHAREGPT_ROLES.get(str(role_raw).lower()) if role_raw is not None else None
            else:
                role_raw, content = t.get("role"), t.get("content")
                role = "system" if role_raw == "developer" else role_raw if role_raw in OPENAI_ROLES else None
            if role_raw is None:
                return Rejected(source, row, f"turn {j}: missing role", rec)
            if role is None:
                return Rejected(source, row, f"turn {j}: unknown role {role_raw!r}", rec)
            if content is None:
                return Rejected(source, row, f"turn {j} ({role}): missing content", rec)
            try:
                text = _content(content)
            except ValueError as e:
                return Rejected(source, row, f"malformed row: turn {j} ({role}): {e}", rec)
            if not text.strip():
                return Rejected(source, row, f"turn {j} ({role}): empty content", rec)
            msgs.append({"role": role, "content": text})
        if not any(m["role"] == "assistant" for m in msgs):
            return Rejected(source, row, "no assistant turn", rec)
        return Conversation(sample_id, msgs, source, row)
    except (ValueError, TypeError, KeyError) as e:
        return Rejected(source, row, f"malformed row: {e}", rec)


@dataclass
class RawRow:
    """One input row before parsing: `rec` is the decoded object, or `err` says why it could not be."""
    source: str
    row: int
    rec: dict | None
    err: str | None
    blob: bytes  # what identifies the row's content (for content-keyed chunks)


def _records(path: Path) -> Iterator[RawRow]:
    src = str(path)
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    yield RawRow(src, i, None, f"malformed JSON line: {e}", line)
                    continue
                yield RawRow(src, i, rec, None if isinstance(rec, dict) else "JSON line is not an object", line)
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            yield RawRow(src, 0, None, f"malformed JSON file: {e}", path.read_bytes()[:4096])
            return
        for i, rec in enumerate(data if isinstance(data, list) else [data]):
            blob = json.dumps(rec, sort_keys=True, default=str).encode()
            yield RawRow(src, i, rec, None if isinstance(rec, dict) else "JSON row is not an object", blob)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, rec in enumerate(pq.read_table(path).to_pylist()):
            yield RawRow(src, i, rec, None, json.dumps(rec, sort_keys=True, default=str).encode())
    elif path.is_dir():
        from datasets import load_from_disk

        for i, rec in enumerate(load_from_disk(src)):
            yield RawRow(src, i, rec, None, json.dumps(rec, sort_keys=True, default=str).encode())
    else:
        raise SourceError(f"{path}: unsupported file type (expected {', '.join(FILE_SUFFIXES)})")


def _hub_rows(name: str, split: str, revision: str | None, token: str | None = None) -> Iterator[RawRow]:
    from datasets import load_dataset

    try:
        ds = load_dataset(name, split=split, revision=revision, token=token)
    except Exception as e:
        raise SourceError(f"dataset source {name!r} is not a local path, and loading it from the Hugging Face "
                          f"hub (split {split!r}, revision {revision!r}) failed: {type(e).__name__}: {e}") from e
    for i, rec in enumerate(ds):
        yield RawRow(f"hub:{name}@{revision or 'main'}/{split}", i, rec, None,
                     json.dumps(rec, sort_keys=True, default=str).encode())


class SourceError(InputError):
    """A source that cannot be opened at all (missing path, hub unreachable)."""


def looks_like_hub_name(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "/", "~")) and not Path(path).suffix


def source_files(path: str | Path) -> list[Path]:
    """The files a source names: a file, a directory of files, or a save_to_disk directory (itself)."""
    p = Path(path)
    if not p.exists():
        raise SourceError(f"dataset source {path!s} does not exist")
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in FILE_SUFFIXES and f.is_file())
        if not files:
            raise SourceError(f"dataset source {path!s}: no {'/'.join(FILE_SUFFIXES)} files inside")
        return files
    return [p]


def raw_rows(path: str, limit: int | None = None, split: str = "train", revision: str | None = None,
             token: str | None = None) -> Iterator[RawRow]:
    """Every row of a source (local file, directory, save_to_disk dir, or hub name), at most `limit`.
    `token` is the hub token for a hub name (never logged)."""
    if not Path(path).exists() and looks_like_hub_name(path):
        it = _hub_rows(path, split, revision, token)
    else:
        it = (r for f in source_files(path) for r in _records(f))
    for n, r in enumerate(it):
        if limit is not None and n >= limit:
            return
        yield r


def parse_row(raw: RawRow, fmt: str = "auto") -> Conversation | Pretokenized | Rejected:
    if raw.err:
        return Rejected(raw.source, raw.row, raw.err, raw.blob.decode(errors="replace")[:2000])
    kind = fmt if fmt != "auto" else detect_format(raw.rec)
    if kind is None:
        return Rejected(raw.source, raw.row, f"unknown format: keys {sorted(raw.rec)[:8]}", raw.rec)
    return normalise(raw.rec, kind, raw.source, raw.row)


def read_source(path: str | Path, fmt: str = "auto", limit: int | None = None
                ) -> Iterator[Conversation | Pretokenized | Rejected]:
    """Every row of a source, normalised or rejected, at most `limit` rows in all."""
    for raw in raw_rows(str(path), limit):
        yield parse_row(raw, fmt)
