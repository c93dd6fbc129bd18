"""The rendering judged against the source conversation (data/mask_check.py `rendering_problem`): each assistant
message's content inside its supervised span, the template's role markers and generation prompt outside it.
A renderer that drops the generation prompt for some rows moves the turn boundary; both mask methods then agree
(they take the same spans), and only this judgment names the row, which prepare quarantines with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import PrepareConfig, TargetConfig
from eagle3_pipeline.data import chat, mask_check
from eagle3_pipeline.data.formats import RawRow, normalise


def _tok(model: Path):
    from eagle3_pipeline.data.tokenized import load_tokenizer

    return load_tokenizer(TargetConfig(model=str(model), trust_remote_code=(model / "tokenization_tiny_moe.py").exists()))


def _items(model: Path, n: int, name: str = "openai.jsonl"):
    lines = (model / "corpus" / name).read_text().splitlines()[:n]
    return [normalise(json.loads(x), "openai", "corpus", i, True) for i, x in enumerate(lines)]


def _drops_generation_prompt(monkeypatch, every: int = 2):
    """chat.render with the generation prompt dropped on every `every`-th call that asks for it."""
    real, calls = chat.render, [0]

    def render(tok, messages, add_generation_prompt=False, tools=None):
        if add_generation_prompt:
            calls[0] += 1
            if calls[0] % every == 0:
                add_generation_prompt = False
        return real(tok, messages, add_generation_prompt, tools)

    monkeypatch.setattr(chat, "render", render)


@pytest.mark.parametrize("name", ["tiny-target", "tiny-moe"])
def test_clean_renderings_pass(name, tiny_target, tiny_moe_target):
    model = Path(tiny_target if name == "tiny-target" else tiny_moe_target)
    tok = _tok(model)
    assert "<|assistant|>" in mask_check.role_markers(tok) and "<|user|>" in mask_check.role_markers(tok)
    names = ["openai.jsonl"] + (["agentic.jsonl"] if name == "tiny-moe" else [])
    for item in [i for n in names for i in _items(model, 60, n)]:
        assert mask_check.encode_checked(tok, item.messages, "conversation", item.tools)


@pytest.mark.parametrize("name", ["tiny-target", "tiny-moe"])
def test_a_dropped_generation_prompt_is_caught_where_both_mask_methods_agree(name, tiny_target, tiny_moe_target,
                                                                             monkeypatch):
    model = Path(tiny_target if name == "tiny-target" else tiny_moe_target)
    tok = _tok(model)
    item = _items(model, 1)[0]
    _drops_generation_prompt(monkeypatch, every=1)
    with monkeypatch.context() as m:  # without the rendering judgment: the moved boundary passes both mask methods
        m.setattr(mask_check, "rendering_problem", lambda *a, **k: None)
        verdicts = [v for _, v in mask_check.encode_checked(tok, item.messages, "conversation", item.tools)]
        assert verdicts and set(verdicts) <= {"agree", "undecided"}, verdicts
    with pytest.raises(mask_check.RenderingWrong, match=r"marker '<\|assistant\|>"):
        mask_check.encode_checked(tok, item.messages, "conversation", item.tools)


def test_content_outside_its_span_is_named(tiny_target):
    tok = _tok(Path(tiny_target))
    item = _items(Path(tiny_target), 1)[0]
    full, turns = chat.render_turns(tok, item.messages)
    t = turns[0]
    late = [chat.Turn(t.ordinal, t.index, t.text, t.start + 3)]  # a boundary moved into the content
    why = mask_check.rendering_problem(tok, item.messages, late, t.text, [(t.start + 3, len(t.text))])
    assert why and "content" in why and "is not inside its supervised span" in why
    assert mask_check.rendering_problem(tok, item.messages, turns, t.text, [(t.start, len(t.text))]) is None


def test_prepare_quarantines_the_rows_whose_rendering_moved(tiny_target, monkeypatch):
    from eagle3_pipeline.prepare.stage import _encode_chunk

    tok = _tok(Path(tiny_target))
    lines = (Path(tiny_target) / "corpus" / "openai.jsonl").read_text().splitlines()[:6]
    rows = [RawRow(source="chats.jsonl", row=i, rec=json.loads(x), err=None, blob=x.encode())
            for i, x in enumerate(lines)]
    cfg = PrepareConfig(sources=[{"path": "chats.jsonl"}])
    _drops_generation_prompt(monkeypatch, every=3)
    cols, rejected, counts = _encode_chunk(rows, "openai", tok, cfg)
    assert rejected and len(cols["input_ids"]) + len(rejected) == 6
    assert all(r["reason"].startswith("rendering does not match the conversation: turn ") for r in rejected)
    assert set(counts["mask_checks"]) <= {"agree", "undecided"}
