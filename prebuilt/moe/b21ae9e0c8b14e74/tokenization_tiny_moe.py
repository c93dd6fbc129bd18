"""Tokenizer of the embedded `tiny-moe` target: byte-level BPE with tiktoken-style rank files.

This file is self-contained on purpose: `build_tiny_moe` copies it into the model directory, where
`tokenizer_config.json` names it in `auto_map`, and both `AutoTokenizer.from_pretrained(dir,
trust_remote_code=True)` and vLLM's engine import it from there (as they import Kimi-K2.5's
`tokenization_kimi.py`). It must therefore import nothing from eagle3_pipeline.

Reads `tiktoken.model`: one line per mergeable token, `<base64 of the token's bytes> <rank>`, ranks
0..n-1 dense. Special tokens are fixed below and take ids n, n+1, ...; no tokenizer.json exists, so
transformers uses this Python backend (no offset mapping). Encoding uses the `tiktoken` package when it
is importable and an equivalent pure-Python rank-merge BPE otherwise.
"""

from __future__ import annotations

import base64
import os
import shutil
from functools import lru_cache

import regex
from transformers import AddedToken, PreTrainedTokenizer

# Split before BPE: words with one leading space, single digits (so arithmetic stays learnable),
# punctuation runs, whitespace. Shared with the trainer in tiny/moe_target.py.
PRETOKENIZE = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
               r"""|\s+(?!\S)|\s+""")

BOS, PAD, EOT = "<|begin|>", "<|pad|>", "<|turn_end|>"
# Order fixes the ids (n_ranks + index); never reorder, only append.
SPECIAL_TOKENS = [
    BOS, PAD, EOT,
    "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",   # turn openers, one per role
    "<|tools|>",                                             # the declared-tools block
    "<|calls|>", "<|call|>", "<|args|>", "<|call_end|>", "<|calls_end|>",  # assistant tool calls
    "<|body|>",                                              # header/body separator (tool results)
    "<think>", "</think>",                                   # reasoning block
]
VOCAB_FILES = {"vocab_file": "tiktoken.model"}


@lru_cache
def byte_to_char() -> dict[int, str]:
    """Printable stand-ins for the 256 byte values (printable ASCII and Latin-1 map to themselves),
    so a token is a str that round-trips through the usual token <-> string APIs."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


class _PurePythonBPE:
    """Rank-merge BPE over bytes, the same algorithm tiktoken runs: repeatedly merge the adjacent
    pair whose concatenation has the lowest rank."""

    def __init__(self, ranks: dict[bytes, int]):
        self.ranks = ranks
        self.pattern = regex.compile(PRETOKENIZE)
        self.cache: dict[bytes, list[int]] = {}

    def _word(self, piece: bytes) -> list[int]:
        if piece in self.ranks:
            return [self.ranks[piece]]
        if piece in self.cache:
            return self.cache[piece]
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if at < 0:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        out = [self.ranks[p] for p in parts]
        self.cache[piece] = out
        return out

    def encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for m in self.pattern.finditer(text):
            ids += self._word(m.group().encode("utf-8"))
        return ids


def make_encoder(ranks: dict[bytes, int]):
    try:
        import tiktoken
    except ImportError:
        return _PurePythonBPE(ranks)
    n = len(ranks)
    return tiktoken.Encoding(name="tiny-moe", pat_str=PRETOKENIZE, mergeable_ranks=ranks,
                             special_tokens={t: n + i for i, t in enumerate(SPECIAL_TOKENS)})


class TinyMoeTokenizer(PreTrainedTokenizer):
    """A `PreTrainedTokenizer` (Python backend) over tiktoken ranks, with the chat special tokens."""

    vocab_files_names = VOCAB_FILES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = BOS, eos_token: str = EOT, pad_token: str = PAD,
                 **kwargs):
        self.vocab_file = vocab_file
        ranks = load_ranks(vocab_file)
        self.n_ranks = len(ranks)
        self.encoder_impl = make_encoder(ranks)
        b2c = byte_to_char()
        self.char_to_byte = {c: b for b, c in b2c.items()}
        self.id_to_token = {r: "".join(b2c[b] for b in tok) for tok, r in ranks.items()}
        self.token_to_id = {t: r for r, t in self.id_to_token.items()}
        self._added_tokens_decoder = {
            self.n_ranks + i: AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False)
            for i, t in enumerate(SPECIAL_TOKENS)}
        kwargs.pop("added_tokens_decoder", None)  # ours are fixed by SPECIAL_TOKENS
        extra = [t for t in SPECIAL_TOKENS if t not in (bos_token, eos_token, pad_token)]
        kwargs.setdefault("extra_special_tokens", extra)
        kwargs.pop("additional_special_tokens", None)
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.n_ranks + len(SPECIAL_TOKENS)

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(self.token_to_id)
        vocab.update({t: self.n_ranks + i for i, t in enumerate(SPECIAL_TOKENS)})
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.id_to_token[i] for i in self.encoder_impl.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.token_to_id[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.id_to_token[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for t in tokens:
            if t in self._added_tokens_encoder:
                out += t.encode("utf-8")
            else:
                out += bytes(self.char_to_byte[c] for c in t)
        return out.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES["vocab_file"]
        dst = os.path.join(save_directory, name)
        if os.path.abspath(dst) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, dst)
        return (dst,)
