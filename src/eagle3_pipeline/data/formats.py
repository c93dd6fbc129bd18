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
            text = _content(content)
            if not text.strip():
                return Rejected(source, row, f"turn {j} ({role}): empty content", rec)
            msgs.append({"role": role, "content": text})
        if not any(m["role"] == "assistant" for m in msgs):
            return Rejected(source, row, "no assistant turn", rec)
        return Conversation(sample_id, msgs, source, row)
    except (ValueError, TypeError, KeyError) as e:
        return Rejected(source, row, f"malformed row: {e}", rec)


def _records(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """(row, record, error) for each row of a file; error set for unreadable rows."""
    if path.suffix == ".jsonl":
        with path.open() as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, None, f"malformed JSON line: {e.msg} at column {e.colno}"
                    continue
                yield (i, rec, None) if isinstance(rec, dict) else (i, None, "JSON line is not an object")
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        for i, rec in enumerate(data if isinstance(data, list) else [data]):
            yield (i, rec, None) if isinstance(rec, dict) else (i, None, "JSON row is not an object")
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, rec in enumerate(pq.read_table(path).to_pylist()):
            yield i, rec, None
    else:
        raise ValueError(f"{path}: unsupported file type (expected {', '.join(FILE_SUFFIXES)})")


def source_files(path: str | Path) -> list[Path]:
    """The files a source names: a file, a directory of files, or a save_to_disk directory (itself)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset source {path!s} does not exist")
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in FILE_SUFFIXES and f.is_file())
        if not files:
            raise FileNotFoundError(f"dataset source {path!s}: no {'/'.join(FILE_SUFFIXES)} files inside")
        return files
    return [p]


def read_source(path: str | Path, fmt: str = "auto", limit: int | None = None
                ) -> Iterator[Conversation | Pretokenized | Rejected]:
    """Every row of a source, normalised or rejected, at most `limit` rows in all."""
    n = 0
    for f in source_files(path):
        if f.is_dir():
            from datasets import load_from_disk

            ds = load_from_disk(str(f))
            rows: Iterator = ((i, r, None) for i, r in enumerate(ds))
        else:
            rows = _records(f)
        for i, rec, err in rows:
            if limit is not None and n >= limit:
                return
            n += 1
            if err:
                yield Rejected(str(f), i, err, None)
                continue
            kind = fmt if fmt != "auto" else detect_format(rec)
            if kind is None:
                yield Rejected(str(f), i, f"unknown format: keys {sorted(rec)[:8]}", rec)
                continue
            yield normalise(rec, kind, str(f), i)
