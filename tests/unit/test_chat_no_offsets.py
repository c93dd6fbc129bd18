"""Loss masks without character offsets (Python-backend tokenizers, e.g. tiktoken-style ones loaded
with trust_remote_code, return no `offset_mapping`): the masks equal those from offsets.

`WordByteTokenizer` is a small `PreTrainedTokenizer` subclass written for these tests: GPT-2-like
pre-tokenization, a few whole-word tokens (with their leading space) and byte tokens for the rest,
so tokens straddle plain-text template boundaries and split multi-byte characters. It knows its own
character offsets (`reference_offsets`), which the library does not return, for an independent check.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizer

from eagle3_pipeline.data.chat import (
    MaskUnavailable,
    _mask_by_decoding,
    _mask_from_offsets,
    encode_conversation,
    encode_text,
    mask_without_offsets,
    render_turns,
)

ROOT = Path(__file__).resolve().parents[2]
PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
WORDS = ["What", " is", " the", " The", " answer", " word", " cat", " reversed", " tac", "Hello", " Hello", " you",
         " are", " terse", " 2", " 3", " 5", " +", " =", ".", ":", " Reverse", "You", "assistant", "user", "system"]
SPECIALS = ["<|bos|>", "<|end|>", "<|im_start|>", "<|im_end|>"]


class WordByteTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, byte_fallback: bool = True, **kwargs):
        self.byte_fallback = byte_fallback  # False: non-ASCII bytes become <unk> (decode does not round-trip)
        self._vocab = {f"<0x{b:02X}>": b for b in range(256)}
        for w in WORDS:
            self._vocab[w] = len(self._vocab)
        self._vocab["<unk>"] = len(self._vocab)
        self._ids = {i: t for t, i in self._vocab.items()}
        super().__init__(bos_token="<|bos|>", eos_token="<|end|>", unk_token="<unk>",
                         additional_special_tokens=SPECIALS[2:], **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return {**self._vocab, **self.added_tokens_encoder}

    def _piece_tokens(self, piece: str) -> list[tuple[str, int]]:
        """(token, character index where it starts, relative to the piece)."""
        if piece in self._vocab:
            return [(piece, 0)]
        out = []
        for i, ch in enumerate(piece):
            for b in ch.encode():
                out.append((f"<0x{b:02X}>" if self.byte_fallback or b < 128 else "<unk>", i))
        return out

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [t for p in PIECE.findall(text) for t, _ in self._piece_tokens(p)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, self._vocab["<unk>"])

    def _convert_id_to_token(self, index: int) -> str:
        return self._ids.get(index, "<unk>")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for t in tokens:
            if re.fullmatch(r"<0x[0-9A-F]{2}>", t):
                out.append(int(t[3:5], 16))
            else:
                out += t.encode()
        return out.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()

    def reference_offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of every token of `text`, computed independently of the library (a byte token
        of a multi-byte character spans that character, as byte-level fast tokenizers report it)."""
        special = re.compile("|".join(re.escape(s) for s in SPECIALS))
        offsets, pos = [], 0
        for m in [*special.finditer(text), None]:
            end = m.start() if m else len(text)
            for p in PIECE.finditer(text[pos:end]):
                for tok, i in self._piece_tokens(p.group()):
                    s = pos + p.start() + i
                    offsets.append((s, pos + p.end() if tok == p.group() else s + 1))
            if m:
                offsets.append((m.start(), m.end()))
                pos = m.end()
        return offsets


class WithoutOffsets:
    """A fast tokenizer seen as a Python-backend one: the same tokens, no `offset_mapping`."""

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, text, **kw):
        kw.pop("return_offsets_mapping", None)
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# plain text at the turn boundary: " Hello" is one token that starts in the head and ends in the span
PLAIN = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}Assistant: {% endif %}")
TEMPLATES = {"tiny": (None, []), "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
             "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"]), "plain": (PLAIN, [])}


def _conv(*pairs, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for u, a in pairs:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs


CONVERSATIONS = [
    _conv(("What is 2 + 3?", "2 + 3 = 5. The answer is 5."), ("Reverse the word cat.", "The word cat reversed is tac."),
          system="You are terse."),
    _conv(("Hello", "Hello you")),
    _conv(("Say it in French", "Très bien, c'est ça — voilà. 日本語も。"), ("emoji?", "🙂👍 ok")),
    _conv(("spaces", "  leading and trailing  "), ("newlines", "\n\nline one\n  line two\n")),
    _conv(("code", "```python\nprint('hi')\n```"), ("é", "é")),
    _conv(("n", "1"), ("m", "x" * 300 + " end")),
]


def _fast(tiny_target, template, specials):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    if template:
        tok.chat_template = template
        tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _rows(tok, msgs, rows_per="conversation"):
    """(text, spans) of every row the conversation gives."""
    from eagle3_pipeline.data.chat import _plan_rows

    full, turns = render_turns(tok, msgs)
    return [(text, spans) for text, spans, _ in _plan_rows(full, turns, rows_per)]


@pytest.mark.parametrize("name", TEMPLATES)
def test_fast_tokenizer_masks_equal_with_and_without_offsets(tiny_target, name):
    tok = _fast(tiny_target, *TEMPLATES[name])
    hidden = WithoutOffsets(tok)
    for msgs in CONVERSATIONS:
        for rows_per in ("conversation", "turn"):
            with_offsets = encode_conversation(tok, msgs, rows_per)
            without = encode_conversation(hidden, msgs, rows_per)
            assert [(r.input_ids, r.loss_mask) for r in with_offsets] == [(r.input_ids, r.loss_mask) for r in without]
            assert all(sum(r.loss_mask) for r in without)
        for text, spans in _rows(tok, msgs):  # the decoding fallback alone gives the same masks too
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            assert _mask_by_decoding(tok, text, spans, enc["input_ids"]) == _mask_from_offsets(enc["offset_mapping"], spans)


def test_plain_text_boundary_takes_the_decoding_path(tiny_target):
    """The tokens straddle the boundary: the pieces do not tokenize like the whole, decoding decides."""
    tok = _fast(tiny_target, PLAIN, [])
    [(text, spans)] = _rows(tok, CONVERSATIONS[0])
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    cuts = sorted({0, len(text), *(c for s in spans for c in s)})
    pieces = tok([text[a:b] for a, b in zip(cuts, cuts[1:])], add_special_tokens=False)["input_ids"]
    assert [t for p in pieces for t in p] != enc["input_ids"]
    assert mask_without_offsets(tok, text, spans, enc["input_ids"]) == _mask_from_offsets(enc["offset_mapping"], spans)


def test_python_backend_tokenizer_has_no_offsets():
    tok = WordByteTokenizer()
    assert not tok.is_fast
    enc = tok("Hello you", add_special_tokens=False, return_offsets_mapping=True)
    assert "offset_mapping" not in enc  # transformers 5: silently absent
    assert tok.decode(enc["input_ids"]) == "Hello you"


@pytest.mark.parametrize("name", ["chatml", "plain", "tiny"])
def test_python_backend_masks_equal_reference_offsets(tiny_target, name):
    tok = WordByteTokenizer()
    template = TEMPLATES[name][0] or _fast(tiny_target, None, []).chat_template
    tok.chat_template = template
    for msgs in CONVERSATIONS:
        for rows_per in ("conversation", "turn"):
            rows = encode_conversation(tok, msgs, rows_per)
            planned = _rows(tok, msgs, rows_per)
            assert len(rows) == len(planned)
            for r, (text, spans) in zip(rows, planned):
                assert r.input_ids == tok(text, add_special_tokens=False)["input_ids"]
                ref = tok.reference_offsets(text)
                assert len(ref) == len(r.input_ids)
                assert r.loss_mask == _mask_from_offsets(ref, spans), (name, msgs)


def test_python_backend_without_round_trip_is_quarantined(tiny_target):
    """No offsets, tokens straddle the boundary, and decoding loses characters: no exact mask."""
    tok = WordByteTokenizer(byte_fallback=False)
    tok.chat_template = PLAIN
    with pytest.raises(MaskUnavailable, match="decoding the tokens does not reproduce the text"):
        encode_conversation(tok, _conv(("Hello", "Hello ü")))
    # where the pieces split cleanly it needs no decoding, round trip or not
    tok.chat_template = CHATML
    [row] = encode_conversation(tok, _conv(("Hello", "Hello ü")))
    assert sum(row.loss_mask) > 0


def test_encode_text_uses_offsets_when_the_tokenizer_has_them(tiny_target, monkeypatch):
    import eagle3_pipeline.data.chat as chat

    tok = _fast(tiny_target, None, [])
    called = []
    monkeypatch.setattr(chat, "mask_without_offsets", lambda *a: called.append(a) or [])
    ids, mask = encode_text(tok, "<|user|>\nhi<|end|>\n", [(0, 5)])
    assert not called and len(ids) == len(mask)


TINY_MOE = Path(os.environ.get("EAGLE3_TINY_MOE", ROOT / ".cache" / "tiny-moe"))


@pytest.mark.skipif(not (TINY_MOE / "tokenizer_config.json").exists(), reason="the tiny MoE target is not built")
def test_tiny_moe_tokenizer_masks_cover_the_assistant_turns():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_MOE, trust_remote_code=True)
    for msgs in CONVERSATIONS:
        rows = encode_conversation(tok, msgs, "turn")
        for r, (text, spans) in zip(rows, _rows(tok, msgs, "turn")):
            assert r.input_ids == tok(text, add_special_tokens=False)["input_ids"]
            [(a, b)] = spans
            got = tok.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m])
            assert got == text[a:b] and r.loss_mask[-1] == 1
            assert _mask_by_decoding(tok, text, spans, r.input_ids) == r.loss_mask
    assert "offset_mapping" not in tok("hi", add_special_tokens=False, return_offsets_mapping=True)


MIXED = "Hello 日本語 é, Très bien — voilà 🙂! The answer: 5"


def test_decoding_matches_offsets_at_every_cut_including_multibyte(tiny_target):
    """Every boundary position, spans on both sides; prefixes that end inside a character are probed."""
    fast = _fast(tiny_target, None, [])
    py = WordByteTokenizer()
    for tok, offsets in ((fast, fast(MIXED, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]),
                         (py, py.reference_offsets(MIXED))):
        ids = tok(MIXED, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(offsets)
        for c in range(len(MIXED) + 1):
            for spans in ([(c, len(MIXED))], [(0, c)], [(c // 2, c)]):
                want = _mask_from_offsets(offsets, spans)
                assert _mask_by_decoding(tok, MIXED, spans, ids) == want, (type(tok).__name__, spans)
                assert mask_without_offsets(tok, MIXED, spans, ids) == want, (type(tok).__name__, spans)
