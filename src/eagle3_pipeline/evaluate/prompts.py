"""The evaluate stage's prompts: a categorized prompt set (`evaluate.prompts`) or prepare's held-out rows.

Which columns a row may give, how it is rendered, what is skipped: docs/internals.md, `evaluate/prompts.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.errors import InputError
from eagle3_pipeline.core.store import atomic_write_text
from eagle3_pipeline.data.chat import render
from eagle3_pipeline.data.formats import RawRow, SourceError, parse_tools, parse_turn, raw_rows, resolve_path
from eagle3_pipeline.records.families import text_config

DEFAULT_CATEGORY = "default"
PROMPT_COLUMNS = ("prompt", "turns", "messages", "conversations")
QUARANTINE_NAME = "prompts.quarantine.jsonl"
LOGGED_SKIPS = 10  # skipped rows named one by one in the log; the rest are counted (all are in the file)


class PromptSetError(InputError):
    """evaluate.prompts cannot be used: missing, unreadable, no chat template, or no usable row."""


TURN_SEP = " · turn "  # category of a later turn: "<category> · turn <n>"


class FollowUp(BaseModel):
    """A later user turn of a prompt row, asked once the target has answered the prompt at `parent`."""
    parent: int  # index in PromptSet.prompts of the turn before
    messages: list[dict]  # the conversation up to and including that turn's user message
    tools: list[dict] | None = None
    turns: list[str]  # the user turns still to come, the next first
    turn: int  # the number of the next turn (2 for MT-Bench's second)
    category: str  # the row's own category
    id: str


class PromptSet(BaseModel):
    """Rendered prompts (token ids), in file order, with one category and id each."""
    source: str  # the evaluate.prompts value, or "heldout:<prepare's heldout.jsonl>"
    prompts: list[list[int]]
    categories: list[str]
    ids: list[str]
    followups: list[FollowUp] = []  # later turns still to ask (evaluate.turns=all)
    answers_max_tokens: int | None = None  # the target's answers to earlier turns were cut at this many tokens
    answers: int = 0  # answers generated for later turns
    answers_cut: int = 0  # of which ended at answers_max_tokens (not at an end of turn)
    rows_in: int = 0  # rows read from the source
    rows_skipped: int = 0  # quarantined (reasons in `quarantine`)
    rows_unused: int = 0  # usable, but beyond evaluate.num_prompts
    skip_reasons: dict[str, int] = {}  # reason kind -> rows
    quarantine: str | None = None

    def category_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.categories:
            out[c] = out.get(c, 0) + 1
        return out

    def summary(self) -> dict:
        """What report.json keeps of the set (details.prompt_set)."""
        out = {"source": self.source, "prompts": len(self.prompts), "categories": self.category_counts(),
               "rows_in": self.rows_in, "rows_skipped": self.rows_skipped, "rows_unused": self.rows_unused,
               "skip_reasons": self.skip_reasons, "quarantine": self.quarantine}
        if self.answers:
            out |= {"answers": self.answers, "answers_cut": self.answers_cut,
                    "answers_max_tokens": self.answers_max_tokens}
        return out


class _Skip(ValueError):
    """A row that is not used; `kind` groups the reasons in the summary."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


# ---------------------------------------------------------------- one row -> messages

def _first_turn(value, column: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, list) and value:
        text = value[0]
        if isinstance(text, dict):  # [{"role": "user", "content": ...}, ...]
            text = text.get("content")
        if not isinstance(text, str):
            raise _Skip("malformed", f"{column}[0] is {type(text).__name__}, expected a string")
    elif isinstance(value, list):
        raise _Skip("empty", f"{column} is an empty list")
    else:
        raise _Skip("malformed", f"{column} is {type(value).__name__}, expected a string or a list of strings")
    if not text.strip():
        raise _Skip("empty", f"{column}: empty user message")
    return text


def _chat(turns, fmt: str) -> list[dict]:
    column = "messages" if fmt == "openai" else "conversations"
    if not isinstance(turns, list) or not turns:
        raise _Skip("empty", f"{column} is not a non-empty list")
    msgs: list[dict] = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            raise _Skip("malformed", f"{column}[{j}] is not an object")
        msg = parse_turn(t, j, fmt, msgs[-1] if msgs else None)
        if isinstance(msg, str):
            raise _Skip("malformed", f"{column}: {msg}")
        if not msgs or msg is not msgs[-1]:  # a ShareGPT function_call turn joins the turn before it
            msgs.append(msg)
    while msgs and msgs[-1]["role"] == "assistant":  # reference answers
        msgs.pop()
    if not msgs or msgs[-1]["role"] not in ("user", "tool"):
        raise _Skip("no prompt", f"{column}: nothing to answer (the conversation, without trailing assistant "
                                 f"turns, must end with a user or tool message)")
    return msgs


def later_turns(rec) -> list[str]:
    """The user turns after the first of a `prompt`/`turns` row (MT-Bench's second turn), non-empty strings only."""
    column = next((c for c in ("prompt", "turns") if isinstance(rec.get(c), list)), None) if isinstance(rec, dict) \
        else None
    if column is None:
        return []
    out = []
    for t in rec[column][1:]:
        text = t.get("content") if isinstance(t, dict) else t
        if not isinstance(text, str) or not text.strip():
            break  # a later turn that is not a question ends the conversation there
        out.append(text)
    return out


def row_messages(rec) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of one prompt row (module doc); raises _Skip with the reason."""
    if not isinstance(rec, dict):
        raise _Skip("malformed", f"row is {type(rec).__name__}, expected an object")
    column = next((c for c in PROMPT_COLUMNS if rec.get(c) is not None), None)
    if column is None:
        raise _Skip("no prompt", f"no prompt: none of the columns {list(PROMPT_COLUMNS)} (found {sorted(rec)[:8]})")
    if column in ("prompt", "turns"):
        msgs = [{"role": "user", "content": _first_turn(rec[column], column)}]
        system = rec.get("system")
        if isinstance(system, str) and system.strip():
            msgs.insert(0, {"role": "system", "content": system})
    else:
        msgs = _chat(rec[column], "openai" if column == "messages" else "sharegpt")
    try:
        tools = parse_tools(rec.get("tools"))
    except ValueError as e:
        raise _Skip("malformed", f"tools: {e}") from None
    return msgs, tools


def row_category(rec: dict) -> str:
    cat = rec.get("category")
    return str(cat).strip() if cat is not None and str(cat).strip() else DEFAULT_CATEGORY


def _row_id(rec: dict, source: str, row: int) -> str:
    for k in ("id", "question_id", "prompt_id", "sample_id"):
        if rec.get(k) is not None:
            return str(rec[k])
    return f"{Path(source).name}:{row}"


# ---------------------------------------------------------------- rendering

def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Token ids of the conversation with the generation prompt (prepare's rendering of held-out prompts)."""
    try:
        text = render(tokenizer, messages, add_generation_prompt=True, tools=tools)
    except Exception as e:  # noqa: BLE001 - a template raising on odd input: the row is skipped with the reason
        raise _Skip("template", f"the chat template failed: {type(e).__name__}: {e}") from None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise _Skip("empty", "the rendered prompt has no tokens")
    return ids


def prompt_token_limit(max_model_len: int | None, model_dir: str, max_tokens: int, num_speculative_tokens: int) -> int | None:
    """The most prompt tokens that leave room for `max_tokens` generated tokens and the drafts: within
    `max_model_len` when set, else within the model's max_position_embeddings (None: unknown, e.g. a hub name)."""
    limit = max_model_len
    if limit is None:
        cfg = Path(model_dir) / "config.json"
        if cfg.is_file():
            try:
                c = json.loads(cfg.read_text())
            except json.JSONDecodeError:
                c = {}
            limit = text_config(c).get("max_position_embeddings")
    if not limit:
        return None
    return int(limit) - max_tokens - num_speculative_tokens - 8  # 8: the evaluate stage's own margin


# ---------------------------------------------------------------- the set

def _rows(source: str, split: str, revision: str | None, token: str | None) -> Iterator[RawRow]:
    p = Path(resolve_path(source))
    if p.is_dir() and (p / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict: pick the split
        from datasets import load_from_disk

        dd = load_from_disk(str(p))
        if split not in dd:
            raise PromptSetError(f"evaluate.prompts {source}: no split {split!r} (splits: {sorted(dd)}); "
                                 f"set evaluate.prompts_split")
        for i, rec in enumerate(dd[split]):
            yield RawRow(f"{source}[{split}]", i, rec, None, b"")
        return
    yield from raw_rows(source, None, split, revision, token)


def select_balanced(categories: list[str], n: int) -> list[int]:
    """Indices of at most `n` items taken round-robin over the categories (in order of first appearance,
    file order within each), returned in file order."""
    if n >= len(categories):
        return list(range(len(categories)))
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        by_cat.setdefault(c, []).append(i)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < n:
        for idx in by_cat.values():
            if depth < len(idx):
                chosen.append(idx[depth])
                if len(chosen) == n:
                    break
        depth += 1
    return sorted(chosen)


def load_prompt_set(source: str, tokenizer, *, num_prompts: int, max_prompt_tokens: int | None = None,
                    split: str = "train", revision: str | None = None, token: str | None = None,
                    quarantine_path: Path | None = None, log: Callable[[str], None] = print,
                    all_turns: bool = False) -> PromptSet:
    """Read, render and select the prompts of `source` (module doc). Skipped rows go to `quarantine_path`
    (JSONL: source, row, id, reason, raw) and the log; raises PromptSetError when nothing is usable. With
    `all_turns` the later turns of `turns` rows are kept as follow-ups of their first turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptSetError(f"evaluate.prompts {source}: tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no "
                             f"chat template, so the prompts cannot be rendered as the target sees them")
    prompts, cats, ids, skipped, later = [], [], [], [], []
    kinds: dict[str, int] = {}
    n_in = 0
    try:
        for raw in _rows(source, split, revision, token):
            n_in += 1
            rec = raw.rec
            try:
                if raw.err:
                    raise _Skip("malformed", raw.err)
                msgs, tools = row_messages(rec)
                p = render_prompt(tokenizer, msgs, tools)
                if max_prompt_tokens is not None and len(p) > max_prompt_tokens:
                    raise _Skip("too long", f"prompt has {len(p)} tokens, more than the {max_prompt_tokens} that leave "
                                            f"room for evaluate.max_tokens and the drafts within the context length")
            except _Skip as e:
                kinds[e.kind] = kinds.get(e.kind, 0) + 1
                skipped.append({"source": raw.source, "row": raw.row,
                                "id": _row_id(rec, raw.source, raw.row) if isinstance(rec, dict) else None,
                                "reason": str(e), "raw": rec if rec is not None else raw.blob.decode(errors="replace")[:2000]})
                if len(skipped) <= LOGGED_SKIPS:
                    log(f"evaluate: prompt {raw.source} row {raw.row} skipped: {e}")
                continue
            prompts.append(p)
            cats.append(row_category(rec))
            ids.append(_row_id(rec, raw.source, raw.row))
            later.append((msgs, tools, later_turns(rec)) if all_turns else None)
    except SourceError as e:
        raise PromptSetError(f"evaluate.prompts: {e}") from e
    quarantine = _quarantine(skipped, f"{n_in} prompt rows of {source}", kinds, quarantine_path, log)
    if not prompts:
        first = f"; first: {skipped[0]['source']} row {skipped[0]['row']}: {skipped[0]['reason']}" if skipped else ""
        raise PromptSetError(f"evaluate.prompts {source}: no usable prompt among {n_in} rows{first}"
                             + (f" (all reasons in {quarantine})" if quarantine else ""))
    keep = select_balanced(cats, num_prompts)
    follow = [FollowUp(parent=j, messages=later[i][0], tools=later[i][1], turns=later[i][2], turn=2,
                       category=cats[i], id=ids[i]) for j, i in enumerate(keep) if later[i] and later[i][2]]
    out = PromptSet(source=source, prompts=[prompts[i] for i in keep], categories=[cats[i] for i in keep],
                    ids=[ids[i] for i in keep], rows_in=n_in, rows_skipped=len(skipped),
                    rows_unused=len(prompts) - len(keep), skip_reasons=kinds, quarantine=quarantine, followups=follow)
    counts = out.category_counts()
    log(f"evaluate: {len(keep)} prompts of {source} in {len(counts)} categories {counts}"
        + (f" ({out.rows_unused} more usable rows beyond evaluate.num_prompts={num_prompts})" if out.rows_unused else "")
        + (f"; {len(follow)} of them have later turns, asked after the target's own answers" if follow else ""))
    return out


def _quarantine(skipped: list[dict], what: str, kinds: dict[str, int], path: Path | None,
                log: Callable[[str], None]) -> str | None:
    """Write the skipped rows to `path` (JSONL) and say so; returns its absolute path (None: nothing written)."""
    if not skipped:
        return None

    if len(skipped) > LOGGED_SKIPS:
        log(f"evaluate: ... {len(skipped) - LOGGED_SKIPS} more prompt rows skipped")
    if path is None:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path), "".join(json.dumps(s, default=str) + "\n" for s in skipped))
    log(f"evaluate: {len(skipped)} of {what} skipped ({kinds}); reasons in {Path(path).resolve()}")
    return str(Path(path).resolve())


def next_turns(pset: PromptSet, answers: dict[int, list[int]], tokenizer, *, max_tokens: int,
               max_prompt_tokens: int | None = None, log: Callable[[str], None] = print) -> PromptSet:
    """The set with each follow-up's next turn added as a prompt: the conversation so far, the target's own
    answer (`answers`: generated token ids by parent index, decoded as a chat client would send it back) and
    the next user turn, rendered with the chat template, in category "<category> · turn <n>". Follow-ups
    with turns after that stay follow-ups of the new prompt; one whose prompt grows too long is dropped and
    counted in skip_reasons."""
    out = pset.model_copy(deep=True)
    out.followups, out.answers_max_tokens = [], max_tokens
    for f in pset.followups:
        ids = answers.get(f.parent)
        if ids is None:
            continue
        out.answers += 1
        out.answers_cut += int(len(ids) >= max_tokens)
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        msgs = [*f.messages, {"role": "assistant", "content": text}, {"role": "user", "content": f.turns[0]}]
        try:
            p = render_prompt(tokenizer, msgs, f.tools)
            if max_prompt_tokens is not None and len(p) > max_prompt_tokens:
                raise _Skip("too long", f"turn {f.turn} has {len(p)} tokens with the answers before it")
        except _Skip as e:
            out.skip_reasons[f"turn {f.turn}: {e.kind}"] = out.skip_reasons.get(f"turn {f.turn}: {e.kind}", 0) + 1
            log(f"evaluate: {f.id} turn {f.turn} skipped: {e}")
            continue
        out.prompts.append(p)
        out.categories.append(f"{f.category}{TURN_SEP}{f.turn}")
        out.ids.append(f"{f.id}{TURN_SEP}{f.turn}")
        if len(f.turns) > 1:
            out.followups.append(f.model_copy(update={"parent": len(out.prompts) - 1, "messages": msgs,
                                                      "turns": f.turns[1:], "turn": f.turn + 1}))
    return out


def turn_of(category: str) -> int:
    """1 for a first turn's category, n for "<category> · turn <n>"."""
    head, sep, n = category.rpartition(TURN_SEP)
    return int(n) if sep and n.isdigit() else 1


def heldout_prompt_set(heldout_path: str | Path, n: int) -> PromptSet:
    """The first `n` held-out conversations of prepare (first prompt's ids), all in category "default"."""
    lines = [json.loads(line) for line in Path(heldout_path).read_text().splitlines()[:n] if line.strip()]
    return PromptSet(source=f"heldout:{heldout_path}", prompts=[r["prompt_ids"] for r in lines],
                     categories=[DEFAULT_CATEGORY] * len(lines),
                     ids=[str(r.get("sample_id", i)) for i, r in enumerate(lines)], rows_in=len(lines))
