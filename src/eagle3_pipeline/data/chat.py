"""Chat template rendering and assistant-only loss masks from render boundaries.

Owns `encode_conversation(tokenizer, messages, rows_per, tools)`. The tokenizer's own chat template
renders the conversation. Each assistant turn j is supervised as the model sees it at inference:
`render(messages[:j+1])` is the history as the template renders it for that turn followed by the
turn, and the turn is the text after `render(messages[:j], add_generation_prompt=True)` (its
content, reasoning and tool calls where the template renders them, and the end-of-turn markup).
A template that does not extend its generation prompt into the turn (`TemplateMismatch`) cannot be
supervised this way; the row is quarantined.

Rows. Templates that render history unchanged give one row per conversation (every turn supervised
in the full rendering). Thinking templates re-render history (the reasoning of earlier turns is
stripped): a turn whose rendering is not a prefix of the full rendering gets a row of its own, the
rendering that ends with that turn; turns whose renderings are prefixes of one another share a row.
`rows_per="turn"` always gives one row per assistant turn (history + that turn, only it supervised).

Tool calls. With `tools` the definitions are passed to the template. A turn's tool calls must appear
in its rendered span (the function name, and the arguments: the JSON string verbatim, or every key
of an object); otherwise, or when the template raises, the other argument form is tried (JSON string
<-> object, see formats.py), then `ToolCallsNotRendered` quarantines the row.

Masks. A token is supervised when its first character lies in a supervised span. Fast tokenizers
give character offsets. Python-backend tokenizers give none; then the text is cut at the span
boundaries and the pieces are tokenized separately: when their concatenation equals the tokens of
the whole text (the usual case: templates put special tokens at turn boundaries) each piece's
tokens take its mask. Otherwise a token straddles a boundary, and token starts are found by decoding
prefixes (binary search per boundary; the decode must reproduce the text exactly), else
`MaskUnavailable` quarantines the row. On a fast tokenizer all three give the same masks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from eagle3_pipeline.core.errors import InputError


class TemplateMismatch(InputError):
    """The template's generation prompt is not a prefix of the rendered assistant turn."""


class ToolCallsNotRendered(TemplateMismatch):
    """The template drops a turn's tool calls, or raises on them."""


class MaskUnavailable(InputError):
    """No exact loss mask: the tokenizer has no offsets and its tokens do not split at the span boundaries."""


@dataclass
class Encoded:
    input_ids: list[int]   # [T]
    loss_mask: list[int]   # [T], 1 on assistant tokens incl. end-of-turn
    turn_index: int | None = None  # the (last) assistant turn this row supervises; None: the whole conversation


@dataclass
class Turn:
    """One assistant turn as the model sees it: `text` = render(messages[:index+1]), the turn = text[start:]."""
    ordinal: int  # k-th assistant turn of the conversation
    index: int    # its message index
    text: str
    start: int


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def assistant_turns(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[Turn]]:
    """The full rendered text and every assistant turn rendered as the last message."""
    full = render(tokenizer, messages, tools=tools)
    turns = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _head(tokenizer, messages[:j], tools)
        upto = full if j == len(messages) - 1 else render(tokenizer, messages[: j + 1], tools=tools)
        if not upto.startswith(head):
            raise TemplateMismatch(f"turn {j}: rendering with the generation prompt is not a prefix of "
                                   f"the rendered turn")
        turns.append(Turn(len(turns), j, upto, len(head)))
    return full, turns


def _head(tokenizer, history: list[dict], tools) -> str:
    """What precedes an assistant turn: the history plus the generation prompt. With no history some
    templates cannot render at all (they index messages[0]); then the turn starts at 0."""
    try:
        return render(tokenizer, history, add_generation_prompt=True, tools=tools)
    except Exception:
        if history:
            raise
        return ""


# ------------------------------------------------------------------------------------ tool calls

def _missing_call(messages: list[dict], turns: list[Turn]) -> str | None:
    """Why some turn's tool calls are not in its rendered span (None: all are)."""
    for t in turns:
        span = t.text[t.start:]
        for call in messages[t.index].get("tool_calls") or ():
            name, args = call["function"]["name"], call["function"]["arguments"]
            if name not in span:
                return f"turn {t.index}: tool call {name!r} is not in the rendered turn"
            if isinstance(args, str) and args not in span:
                return f"turn {t.index}: the arguments of tool call {name!r} are not in the rendered turn as given"
            if isinstance(args, dict):
                missing = [k for k in args if str(k) not in span]
                if missing:
                    return f"turn {t.index}: argument(s) {missing[:3]} of tool call {name!r} are not in the rendered turn"
    return None


def other_argument_form(messages: list[dict]) -> list[dict] | None:
    """The messages with every tool call's arguments in the other form (JSON string <-> object); None
    when some string is not a JSON object (there is no other form)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        return None
                    if not isinstance(args, dict):
                        return None
                else:
                    args = json.dumps(args, ensure_ascii=False)
                calls.append({**c, "function": {**c["function"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def render_turns(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[Turn]]:
    """`assistant_turns`, with every tool call checked to be rendered (in either argument form)."""
    if not any(m.get("tool_calls") for m in messages):
        return assistant_turns(tokenizer, messages, tools)
    form_name = "JSON strings" if any(isinstance(c["function"]["arguments"], str)
                                      for m in messages for c in m.get("tool_calls") or ()) else "objects"
    failures = []
    for form, name in ((messages, f"arguments as given ({form_name})"), (other_argument_form(messages), "converted")):
        if form is None:
            continue
        try:
            full, turns = assistant_turns(tokenizer, form, tools)
        except Exception as e:  # a template that cannot handle tool calls often raises (None content, str + dict)
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        why = _missing_call(form, turns)
        if why is None:
            return full, turns
        failures.append(f"{name}: {why}")
    raise ToolCallsNotRendered("; ".join(failures))


# ------------------------------------------------------------------------------------ rows

def _plan_rows(full: str, turns: list[Turn], rows_per: str) -> list[tuple[str, list[tuple[int, int]], int | None]]:
    """(text, supervised spans, turn index) per row; see the module docstring."""
    if rows_per == "turn":
        return [(t.text, [(t.start, len(t.text))], t.ordinal) for t in turns]
    if not turns:  # nothing to supervise: one unsupervised row, which prepare then quarantines
        return [(full, [], None)]
    groups: list[tuple[str, list[Turn]]] = []
    left = list(turns)
    covered = [t for t in left if full.startswith(t.text)]
    if covered:
        groups.append((full, covered))
        left = [t for t in left if t not in covered]
    while left:  # history was re-rendered: the latest remaining turn anchors the next row
        anchor = left[-1].text
        covered = [t for t in left if anchor.startswith(t.text)]
        groups.append((anchor, covered))
        left = [t for t in left if t not in covered]
    groups.sort(key=lambda g: g[1][-1].ordinal)
    single = len(groups) == 1
    return [(text, [(t.start, len(t.text)) for t in ts], None if single else ts[-1].ordinal) for text, ts in groups]


def encode_conversation(tokenizer, messages: list[dict], rows_per: str = "conversation",
                        tools: list[dict] | None = None) -> list[Encoded]:
    """Token ids + loss mask: one row for the conversation (more where the template re-renders
    history), or one row per assistant turn."""
    full, turns = render_turns(tokenizer, messages, tools)
    return [Encoded(*encode_text(tokenizer, text, spans), k) for text, spans, k in _plan_rows(full, turns, rows_per)]


# ------------------------------------------------------------------------------------ masks

def encode_text(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token ids of `text` and the mask of the tokens whose first character lies in a span."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = enc.get("offset_mapping")
    if offsets is not None:
        return ids, _mask_from_offsets(offsets, spans)
    return ids, mask_without_offsets(tokenizer, text, spans, ids)


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = []
    for s, e in offsets:
        mask.append(int(e > s and any(a <= s < b for a, b in spans)))
    return mask


def mask_without_offsets(tokenizer, text: str, spans: list[tuple[int, int]], ids: list[int]) -> list[int]:
    """The offset rule without offsets: by tokenizing the pieces between span boundaries, else by decoding."""
    cuts = sorted({0, len(text), *(c for s in spans for c in s if 0 <= c <= len(text))})
    bounds = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    pieces = tokenizer([text[a:b] for a, b in bounds], add_special_tokens=False)["input_ids"] if bounds else []
    if [t for p in pieces for t in p] == ids:
        mask = []
        for (a, _), p in zip(bounds, pieces):
            mask += [int(any(s <= a < e for s, e in spans))] * len(p)
        return mask
    return _mask_by_decoding(tokenizer, text, spans, ids)


def _mask_by_decoding(tokenizer, text: str, spans: list[tuple[int, int]], ids: list[int]) -> list[int]:
    """Token k starts at len(decode(ids[:k])) (a prefix ending inside a multi-byte character decodes
    with trailing U+FFFD: the token continues the character that starts there). Starts are
    non-decreasing, so the first token at or after each boundary is found by binary search."""
    def decode(k: int) -> str:
        return tokenizer.decode(ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    if decode(len(ids)) != text:
        raise MaskUnavailable(f"tokenizer {name} gives no character offsets, its tokens do not split at the "
                              f"supervised span boundaries, and decoding the tokens does not reproduce the text")

    def start(k: int) -> int:
        d = decode(k)
        if not text.startswith(d):
            d = d.rstrip("\ufffd")
            if not text.startswith(d):
                raise MaskUnavailable(f"tokenizer {name} gives no character offsets, and the first {k} tokens "
                                      f"do not decode to a prefix of the text")
        return len(d)

    def first_at(c: int) -> int:  # the first token that starts at or after character c
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if start(mid) >= c:
                hi = mid
            else:
                lo = mid + 1
        return lo

    mask = [0] * len(ids)
    for a, b in spans:
        for k in range(first_at(a), first_at(b)):
            mask[k] = 1
    return mask
