"""Input readers: every source row becomes a `Conversation` or a `Rejected` with its reason.

Owns format detection and normalisation of ShareGPT (`conversations`: `from`/`value`, roles
human/gpt/system), OpenAI (`messages`: `role`/`content`, system/tool turns, list-of-parts content)
and pre-tokenized (`input_ids` + `loss_mask`) rows.

Tool use is data: OpenAI rows keep a top-level `tools` list, assistant `tool_calls` (content null
or text; the legacy `function_call` field becomes one tool call) and `tool` messages with their
`tool_call_id`/`name`. ShareGPT agentic rows (`function_call` turns whose value is a JSON call or
list of calls, `observation` turns, `tools` as a JSON string, a top-level `system` string) are
normalised to the same shape. Every tool call becomes `{"type": "function", "function": {"name",
"arguments"}}` (plus `id` when the data has one); `arguments` stays as the data has it (a JSON
string or an object): chat/`encode_conversation` renders it that way first and switches to the
other form only when the template does not render it (a template that applies `tojson` to a
string, or concatenates an object). Assistant `reasoning_content` is kept for thinking templates;
inline `<think>` blocks simply stay in the content. A plain turn is exactly `{"role", "content"}`. Reads local `.jsonl`/`.json`/`.parquet` files or
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
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
                  "function_call": "assistant"}  # function_call: the assistant's call(s), as JSON
OPENAI_ROLES = {"system", "user", "assistant", "tool"}
OPENAI_ALIASES = {"developer": "system", "function": "tool"}  # function: the legacy function-result role
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class Conversation:
    sample_id: str
    messages: list[dict]  # normalised: role in {system,user,assistant,tool}, content: str (None only beside
    source: str           # tool_calls); optional tool_calls, reasoning_content, name, tool_call_id
    row: int
    tools: list[dict] | None = None  # OpenAI tool definitions ({"type": "function", "function": {...}})


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


def _json_value(v: Any, what: str) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    return v


def _tools(raw: Any) -> list[dict] | None:
    """Top-level tool definitions: an OpenAI list, or (ShareGPT) a JSON string of one; bare function
    definitions (`{"name", "description", "parameters"}`) are wrapped as OpenAI function tools."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    tools = _json_value(raw, "tools")
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise ValueError(f"tools is {type(tools).__name__}, expected a list of tool definitions")
    out = []
    for i, t in enumerate(tools):
        if isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str):
            out.append(t)
        elif isinstance(t, dict) and isinstance(t.get("name"), str):
            out.append({"type": "function", "function": t})
        else:
            raise ValueError(f"tool {i} is not a function definition with a name: {str(t)[:80]!r}")
    return out or None


def _tool_calls(raw: Any, what: str = "tool_calls") -> list[dict]:
    """Assistant tool calls (OpenAI nested or flat `{"name", "arguments"}`), arguments kept as given."""
    calls = _json_value(raw, what)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{what} is not a call or a non-empty list of calls")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{what}[{i}] has no function name: {str(c)[:80]!r}")
        args = fn.get("arguments", {})
        if not isinstance(args, (str, dict)):
            raise ValueError(f"{what}[{i}] ({fn['name']}): arguments is {type(args).__name__}, expected "
                             f"a JSON string or an object")
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c, dict) and isinstance(c.get("id"), str):
            call = {"id": c["id"], **call}
        out.append(call)
    return out


def _turn(t: dict, j: int, fmt: str, prev: dict | None) -> dict | str:
    """One normalised message, or the reason the row is rejected. `prev` is the message before it,
    to which a ShareGPT `function_call` turn following a plain `gpt` turn is attached."""
    if fmt == "sharegpt":
        role_raw, content = t.get("from"), t.get("value")
        role = SHAREGPT_ROLES.get(str(role_raw).lower()) if role_raw is not None else None
    else:
        role_raw, content = t.get("role"), t.get("content")
        role = OPENAI_ALIASES.get(role_raw, role_raw if role_raw in OPENAI_ROLES else None)
    if role_raw is None:
        return f"turn {j}: missing role"
    if role is None:
        return f"turn {j}: unknown role {role_raw!r}"
    calls = None
    try:
        if fmt == "sharegpt" and str(role_raw).lower() == "function_call":
            if content is None:
                return f"turn {j} (function_call): missing content"
            calls, content = _tool_calls(content, "function_call"), None
        elif role == "assistant" and fmt == "openai" and (t.get("tool_calls") or t.get("function_call")):
            calls = _tool_calls(t["tool_calls"] if t.get("tool_calls") else t["function_call"],
                                "tool_calls" if t.get("tool_calls") else "function_call")
    except ValueError as e:
        return f"malformed row: turn {j} ({role}): {e}"
    if content is None and not calls:
        return f"turn {j} ({role}): missing content"
    text = None
    if content is not None:
        try:
            text = _content(content)
        except ValueError as e:
            return f"malformed row: turn {j} ({role}): {e}"
        if not text.strip() and not calls:
            return f"turn {j} ({role}): empty content"
    if calls and fmt == "sharegpt" and prev is not None and prev["role"] == "assistant" and "tool_calls" not in prev:
        prev["tool_calls"] = calls  # the gpt turn's text and its calls are one assistant turn
        return prev
    msg = {"role": role, "content": text}
    if calls:
        msg["tool_calls"] = calls
    if role == "assistant" and isinstance(t.get("reasoning_content"), str) and t["reasoning_content"]:
        msg["reasoning_content"] = t["reasoning_content"]
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(t.get(k), str):
                msg[k] = t[k]
    return msg


def normalise(rec: dict, fmt: str, source: str, row: int,
              require_assistant: bool = True) -> Conversation | Pretokenized | Rejected:
    """`require_assistant=False`: a conversation without an assistant turn (prompts only) is kept
    (regenerate answers it); prepare rejects it, there is nothing to supervise."""
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
        msgs: list[dict] = []
        if fmt == "sharegpt" and isinstance(rec.get("system"), str) and rec["system"].strip():
            first = turns[0].get("from") if isinstance(turns[0], dict) else None
            if str(first).lower() != "system":  # LLaMA-Factory style: the system prompt is a column
                msgs.append({"role": "system", "content": rec["system"]})
        for j, t in enumerate(turns):
            if not isinstance(t, dict):
                return Rejected(source, row, f"turn {j} is not an object", rec)
            msg = _turn(t, j, fmt, msgs[-1] if msgs else None)
            if isinstance(msg, str):
                return Rejected(source, row, msg, rec)
            if not msgs or msg is not msgs[-1]:
                msgs.append(msg)
        if require_assistant and not any(m["role"] == "assistant" for m in msgs):
            return Rejected(source, row, "no assistant turn", rec)
        try:
            tools = _tools(rec.get("tools"))
        except ValueError as e:
            return Rejected(source, row, f"malformed row: {e}", rec)
        return Conversation(sample_id, msgs, source, row, tools)
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


def parse_row(raw: RawRow, fmt: str = "auto", require_assistant: bool = True) -> Conversation | Pretokenized | Rejected:
    if raw.err:
        return Rejected(raw.source, raw.row, raw.err, raw.blob.decode(errors="replace")[:2000])
    kind = fmt if fmt != "auto" else detect_format(raw.rec)
    if kind is None:
        return Rejected(raw.source, raw.row, f"unknown format: keys {sorted(raw.rec)[:8]}", raw.rec)
    return normalise(raw.rec, kind, raw.source, raw.row, require_assistant)


def read_source(path: str | Path, fmt: str = "auto", limit: int | None = None
                ) -> Iterator[Conversation | Pretokenized | Rejected]:
    """Every row of a source, normalised or rejected, at most `limit` rows in all."""
    for raw in raw_rows(str(path), limit):
        yield parse_row(raw, fmt)
