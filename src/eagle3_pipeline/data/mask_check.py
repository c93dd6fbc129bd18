"""A second opinion on every loss mask, independent of how data/chat.py found it (offsets, pieces or decoding):
each assistant turn's tokens located in token space; and a judgment of the rendering itself against the source
conversation (`rendering_problem`): each assistant message's content inside its supervised span, the template's
role markers and generation prompt outside it. Owns `encode_checked` (what prepare calls: chat's rows, each
judged), `MaskDisagrees` and `RenderingWrong`. Kept beside chat.py, not in it: chat.py is part of the tiny targets' build key
(tiny/build_cache.py), and this check changes no byte of a row it passes.
"""

from __future__ import annotations

from eagle3_pipeline.core.errors import InputError
from eagle3_pipeline.data import chat


class MaskDisagrees(InputError):
    """The loss mask differs from the supervised tokens a second, independent method finds (`second_opinion`)."""


class RenderingWrong(InputError):
    """A supervised span that does not hold its assistant message's content, or holds a role marker or the
    generation prompt (`rendering_problem`): the turn boundary itself is wrong, whatever the mask methods say."""


def encode_checked(tokenizer, messages: list[dict], rows_per: str = "conversation",
                   tools: list[dict] | None = None) -> list[tuple[chat.Encoded, str]]:
    """chat.encode_conversation's rows, each with `second_opinion`'s verdict ("agree" or "undecided"); raises
    MaskDisagrees when a row's mask differs, RenderingWrong when a row's spans fail `rendering_problem`."""
    full, turns = chat.render_turns(tokenizer, messages, tools)
    out = []
    for text, spans, k in chat._plan_rows(full, turns, rows_per):  # noqa: SLF001 - chat.py's row plan, unchanged
        why = rendering_problem(tokenizer, messages, turns, text, spans)
        if why:
            raise RenderingWrong(why)
        ids, mask = chat.encode_text(tokenizer, text, spans)
        verdict, why = second_opinion(tokenizer, text, spans, ids, mask)
        if verdict == "disagree":
            raise MaskDisagrees(why)
        out.append((chat.Encoded(ids, mask, k), verdict))
    return out


def second_opinion(tokenizer, text: str, spans: list[tuple[int, int]], ids: list[int],
                   mask: list[int]) -> tuple[str, str | None]:
    """The supervised tokens found a second way, in token space and without offsets or decoding: each turn's
    history-with-generation-prompt (text[:start]) and the history with the turn (text[:end]) are tokenized on
    their own; where both are token prefixes of the row, the turn's tokens are exactly those between them.
    ("agree" | "undecided" | "disagree", why): undecided where a token straddles a turn's boundary (no token
    prefix ends there: the first method's offsets or decoding decide alone)."""
    want = [0] * len(ids)
    for a, b in spans:
        head = tokenizer(text[:a], add_special_tokens=False)["input_ids"] if a else []
        upto = tokenizer(text[:b], add_special_tokens=False)["input_ids"] if b < len(text) else ids
        if ids[:len(head)] != list(head) or ids[:len(upto)] != list(upto):
            return "undecided", None
        for t in range(len(head), len(upto)):
            want[t] = 1
    if want == list(mask):
        return "agree", None
    diff = [t for t, (w, m) in enumerate(zip(want, mask)) if w != m]
    return "disagree", (f"{len(diff)} of {len(ids)} tokens (positions {diff[:8]}{' ...' if len(diff) > 8 else ''}) are "
                        f"{'supervised' if mask[diff[0]] else 'not supervised'} but the assistant turns' own token "
                        f"spans (each turn tokenized with its history, prefix by prefix) say "
                        f"{'not' if mask[diff[0]] else 'they are'}")


_MARKERS: dict[tuple[str, str], tuple[str, ...]] = {}
_PROBE = ("\x01u1\x01", "\x01a1\x01", "\x01u2\x01")


def role_markers(tokenizer) -> tuple[str, ...]:
    """The template's own markup around turns, found from a probe conversation rendered without the generation
    prompt flag (so a renderer that drops it for some rows cannot hide it here): what the assistant turn adds
    before its content, what a user turn adds before its content, and the generation prompt. Empty where the
    probe cannot be rendered (a template that insists on a system turn or on its own alternation)."""
    key = (str(getattr(tokenizer, "name_or_path", "")), str(getattr(tokenizer, "chat_template", "")))
    if key in _MARKERS:
        return _MARKERS[key]
    u1, a1, u2 = _PROBE
    msgs = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
    found = []
    try:
        r1, r2, r3 = (tokenizer.apply_chat_template(msgs[:n], tokenize=False) for n in (1, 2, 3))
        gen = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    except Exception:
        r1 = r2 = r3 = gen = ""
    for before, after, content in ((r1, r2, a1), (r2, r3, u2)):
        if before and after.startswith(before) and content in after[len(before):]:
            found.append(after[len(before):after.index(content, len(before))])
    if r1 and gen.startswith(r1):
        found.append(gen[len(r1):])
    _MARKERS[key] = tuple(sorted({m.strip() for m in found if len(m.strip()) >= 2}, key=len, reverse=True))
    return _MARKERS[key]


def _content_forms(msg: dict) -> list[str]:
    """The assistant content as a template may render it: as given (stripped), or only what follows an inline
    reasoning block (thinking templates drop history's reasoning)."""
    c = msg.get("content")
    if not isinstance(c, str) or not c.strip():
        return []
    forms = [c.strip()]
    if "</think>" in c and c.split("</think>")[-1].strip():
        forms.append(c.split("</think>")[-1].strip())
    return forms


def rendering_problem(tokenizer, messages: list[dict], turns: list[chat.Turn], text: str,
                      spans: list[tuple[int, int]]) -> str | None:
    """Why a row's supervised spans do not match its source conversation (None: they do). Each span (a, b) is
    an assistant turn's rendering; its message's content must lie inside it, and no role marker or generation
    prompt (`role_markers`) may lie inside it outside the content: a boundary moved by the renderer (the
    generation prompt dropped, a turn cut short) fails here even where both mask methods agree."""
    markers = role_markers(tokenizer)
    for a, b in spans:
        turn = next((t for t in turns if t.start == a and len(t.text) == b and text.startswith(t.text)), None)
        if turn is None:
            continue
        span, msg = text[a:b], messages[turn.index]
        forms = _content_forms(msg)
        at = next(((span.index(f), f) for f in forms if f in span), None)
        if forms and at is None:
            return (f"turn {turn.index}: the assistant message's content ({forms[0][:40]!r}...) is not inside its "
                    f"supervised span ({span[:60]!r}...)")
        outside = (span[:at[0]], span[at[0] + len(at[1]):]) if at else (span,)
        bad = next((m for m in markers for part in outside if m in part), None)
        if bad is not None:
            return (f"turn {turn.index}: the supervised span holds the template's marker {bad!r} outside the "
                    f"message's content (span starts {span[:60]!r}): the turn boundary is wrong (a generation "
                    f"prompt dropped or a role marker supervised)")
    return None
