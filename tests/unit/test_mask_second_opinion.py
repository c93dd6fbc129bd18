"""Loss masks judged against the source by a second method (data/mask_check.py `second_opinion`): each assistant turn's
tokens found by tokenizing its history, prefix by prefix, in token space (no offsets, no decoding). Clean rows of
both tiny targets (the Llama's fast tokenizer; the Kimi-like MoE's Python tokenizer, thinking and tools) agree
or are undecided; a mask one token off, from either of prepare's paths, is refused and prepare quarantines the
conversation with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import PrepareConfig, TargetConfig
from eagle3_pipeline.data import chat, mask_check
from eagle3_pipeline.data.formats import RawRow

ROOT = Path(__file__).resolve().parents[2]


def _tok(model: Path):
    from eagle3_pipeline.data.tokenized import load_tokenizer

    return load_tokenizer(TargetConfig(model=str(model), trust_remote_code=(model / "tokenization_tiny_moe.py").exists()))


def _conversations(model: Path, n: int) -> list[dict]:
    lines = (model / "corpus" / "openai.jsonl").read_text().splitlines()[:n]
    return [json.loads(x) for x in lines]


def _shifted(fn):
    """A mask path that is one token late: the kind of bug a template or tokenizer quirk makes."""
    def wrapped(*a, **k):
        m = fn(*a, **k)
        return [0] + m[:-1]
    return wrapped


@pytest.mark.parametrize("name", ["tiny-target", "tiny-moe"])
def test_clean_masks_agree_with_the_turns_token_spans(name, tiny_target, tiny_moe_target):
    model = tiny_target if name == "tiny-target" else tiny_moe_target
    tok = _tok(Path(model))
    verdicts = {}
    for conv in _conversations(Path(model), 60):
        from eagle3_pipeline.data.formats import normalise

        item = normalise(conv, "openai", "corpus", 0, True)
        for _, verdict in mask_check.encode_checked(tok, item.messages, "conversation", item.tools):
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
    assert verdicts.get("agree", 0) >= 50 and set(verdicts) <= {"agree", "undecided"}, verdicts


@pytest.mark.parametrize("name, path", [("tiny-target", "_mask_from_offsets"), ("tiny-moe", "mask_without_offsets")])
def test_a_mask_one_token_off_is_refused(name, path, tiny_target, tiny_moe_target, monkeypatch):
    """Offsets (the fast tokenizer) or pieces and decoding (Kimi-like Python tokenizer): one token late."""
    model = Path(tiny_target if name == "tiny-target" else tiny_moe_target)
    tok = _tok(model)
    from eagle3_pipeline.data.formats import normalise

    item = normalise(_conversations(model, 1)[0], "openai", "corpus", 0, True)
    monkeypatch.setattr(chat, path, _shifted(getattr(chat, path)))
    with pytest.raises(mask_check.MaskDisagrees, match=r"tokens \(positions \[\d+"):
        mask_check.encode_checked(tok, item.messages, "conversation", item.tools)


def test_prepare_quarantines_a_conversation_whose_mask_disagrees(tiny_target, monkeypatch):
    from eagle3_pipeline.prepare.stage import _encode_chunk

    tok = _tok(Path(tiny_target))
    convs = _conversations(Path(tiny_target), 3)
    rows = [RawRow(source="chats.jsonl", row=i, rec=c, err=None, blob=json.dumps(c).encode()) for i, c in enumerate(convs)]
    cols, rejected, counts = _encode_chunk(rows, "openai", tok, PrepareConfig(sources=[{"path": "chats.jsonl"}]))
    assert len(cols["input_ids"]) == 3 and not rejected and counts["mask_checks"] == {"agree": 3}
    monkeypatch.setattr(chat, "_mask_from_offsets", _shifted(chat._mask_from_offsets))
    cols, rejected, counts = _encode_chunk(rows, "openai", tok, PrepareConfig(sources=[{"path": "chats.jsonl"}]))
    assert not cols["input_ids"] and [r["row"] for r in rejected] == [0, 1, 2]
    assert all(r["reason"].startswith("loss mask disagrees with the turns' token spans: ") for r in rejected)
