"""A second opinion on every loss mask, independent of how data/chat.py found it (offsets, pieces or decoding):
each assistant turn's tokens located in token space. Owns `encode_checked` (what prepare calls: chat's rows,
each judged) and `MaskDisagrees`. Kept beside chat.py, not in it: chat.py is part of the tiny targets' build key
(tiny/build_cache.py), and this check changes no byte of a row it passes.
"""

from __future__ import annotations

from eagle3_pipeline.core.errors import InputError
from eagle3_pipeline.data import chat


class MaskDisagrees(InputError):
    """The loss mask differs from the supervised tokens a second, independent method finds (`second_opinion`)."""


def encode_checked(tokenizer, messages: list[dict], rows_per: str = "conversation",
                   tools: list[dict] | None = None) -> list[tuple[chat.Encoded, str]]:
    """chat.encode_conversation's rows, each with `second_opinion`'s verdict ("agree" or "undecided"); raises
    MaskDisagrees when a row's mask differs."""
    full, turns = chat.render_turns(tokenizer, messages, tools)
    out = []
    for text, spans, k in chat._plan_rows(full, turns, rows_per):  # noqa: SLF001 - chat.py's row plan, unchanged
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
