"""Chat template rendering and assistant-only loss masks from render boundaries.

Owns `encode_conversation(tokenizer, messages, ...)`: the tokenizer's own chat template renders the
conversation; for each assistant turn j the supervised span is the text between
render(messages[:j], add_generation_prompt=True) and render(messages[:j+1]) — the assistant's
content plus the template's end-of-turn markup. Each render must be a prefix of the next and of the
full render; a template that re-renders history differently is reported as `TemplateMismatch` for
that row. Tokens are masked when their first character lies in a supervised span.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_pipeline.errors import InputError


class TemplateMismatch(InputError):
    """The template does not render a conversation prefix as a prefix of the longer conversation."""


@dataclass
class Encoded:
    input_ids: list[int]   # [T]
    loss_mask: list[int]   # [T], 1 on assistant tokens incl. end-of-turn
    turn_index: int | None = None  # which assistant turn this row supervises (rows_per == "turn")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the (start, end) character span of every assistant turn."""
    full = render(tokenizer, messages)
    spans = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _head(tokenizer, messages[:j])
        upto = render(tokenizer, messages[: j + 1])
        if not upto.startswith(head):
            raise TemplateMismatch(f"turn {j}: rendering with the generation prompt is not a prefix of "
                                   f"the rendered turn (template re-renders history)")
        if not full.startswith(upto):
            raise TemplateMismatch(f"turn {j}: the conversation up to this turn is not a prefix of the "
                                   f"full rendering (template re-renders history)")
        spans.append((len(head), len(upto)))
    return full, spans


def _head(tokenizer, history: list[dict]) -> str:
    """What precedes an assistant turn: the history plus the generation prompt. With no history some
    templates cannot render at all (they index messages[0]); then the turn starts at 0."""
    try:
        return render(tokenizer, history, add_generation_prompt=True)
    except Exception:
        if history:
            raise
        return ""


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = []
    for s, e in offsets:
        mask.append(int(e > s and any(a <= s < b for a, b in spans)))
    return mask


def encode_conversation(tokenizer, messages: list[dict], rows_per: str = "conversation") -> list[Encoded]:
    """Token ids + loss mask: one row for the conversation, or one row per assistant turn."""
    full, spans = assistant_spans(tokenizer, messages)
    if rows_per == "conversation":
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        return [Encoded(list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans))]
    rows = []
    for k, (a, b) in enumerate(spans):
        text = full[:b]
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        rows.append(Encoded(list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], [(a, b)]), k))
    return rows
