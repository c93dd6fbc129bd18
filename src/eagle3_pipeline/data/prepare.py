"""The prepare stage: chat rows in -> tokenized Arrow dataset, token frequencies, quarantine.

Reads the configured sources (data/formats.py) and the tokenizer with its chat template. Writes,
under <store>/<dataset>/<tokenized-version>/ (store.py layout):
  tokenized/             datasets.save_to_disk: input_ids int64[T], loss_mask int64[T], seq_len, sample_id
  token_freq.safetensors counts int64[V]: how often each token id is supervised (loss_mask == 1)
  heldout.jsonl          conversations kept out of training (first user prompt ids + reference answer)
  quarantine.jsonl       every rejected row: source file, row, reason
  prepare.json           counts and the version's inputs; its presence marks the version complete
Invariant: rows_in == rows_out + rows_heldout + rows_quarantined (counted per source row).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.config import PrepareConfig, TargetConfig
from eagle3_pipeline.data.chat import TemplateMismatch, encode_conversation, render
from eagle3_pipeline.data.formats import Conversation, Pretokenized, Rejected, read_source
from eagle3_pipeline.store import atomic_write_text, content_key, dir_fingerprint, read_json, slug, write_json

TOKENIZER_FILES = ("tokenizer*.json", "special_tokens_map.json", "*.jinja", "*.model", "vocab*", "merges.txt")


class PrepareResult(BaseModel):
    version: str
    dir: str
    tokenized: str
    token_freq: str
    heldout: str
    quarantine: str
    rows_in: int
    rows_out: int
    rows_heldout: int
    rows_quarantined: int
    rows_truncated: int
    tokens: int
    supervised_tokens: int
    quarantine_reasons: dict[str, int]
    cached: bool = False


def load_tokenizer(target: TargetConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target.tokenizer, revision=target.revision,
                                         trust_remote_code=target.trust_remote_code)


def prepare_version(cfg: PrepareConfig, target: TargetConfig, tokenizer) -> str:
    """Content key of everything that determines the prepared bytes."""
    return content_key({
        "sources": [{"fp": dir_fingerprint(Path(s.path)), "format": s.format, "limit": s.limit} for s in cfg.sources],
        "tokenizer": dir_fingerprint(Path(target.tokenizer), TOKENIZER_FILES) if Path(target.tokenizer).exists()
        else f"{target.tokenizer}@{target.revision}",
        "template": tokenizer.chat_template,
        "max_length": cfg.max_length, "min_supervised": cfg.min_supervised_tokens,
        "rows_per": cfg.rows_per, "heldout": cfg.heldout_rows,
    })


def _heldout_ids(convs: list[Conversation], n: int) -> set[str]:
    """A stable choice: the n conversations whose id hashes lowest (independent of input order)."""
    order = sorted(convs, key=lambda c: hashlib.sha256(c.sample_id.encode()).hexdigest())
    return {c.sample_id for c in order[:n]}


def prepare(cfg: PrepareConfig, target: TargetConfig, store_root: Path, log=print) -> PrepareResult:
    """Run the prepare stage, or return the complete version already in the store."""
    tok = load_tokenizer(target)
    version = prepare_version(cfg, target, tok)
    out = Path(store_root) / slug(cfg.dataset) / version
    done = read_json(out / "prepare.json")
    if done is not None:
        log(f"prepare: version {version} already complete at {out}")
        return PrepareResult(**{**done, "cached": True})

    rejected: list[Rejected] = []
    convs: list[Conversation] = []
    pretok: list[Pretokenized] = []
    seen: set[str] = set()
    rows_in = 0
    for src in cfg.sources:
        for item in read_source(src.path, src.format, src.limit):
            rows_in += 1
            if isinstance(item, Rejected):
                rejected.append(item)
            elif item.sample_id in seen:
                rejected.append(Rejected(item.source, item.row, f"duplicate id {item.sample_id!r}"))
            else:
                seen.add(item.sample_id)
                (convs if isinstance(item, Conversation) else pretok).append(item)

    held = _heldout_ids(convs, cfg.heldout_rows)
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": [], "sample_id": []}
    heldout_lines, truncated = [], 0
    vocab = len(tok)
    counts = [0] * vocab

    def add_row(sample_id: str, ids: list[int], mask: list[int], where: tuple[str, int]) -> None:
        nonlocal truncated
        if len(ids) > cfg.max_length:
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            truncated += 1
        if sum(mask) < cfg.min_supervised_tokens:
            rejected.append(Rejected(*where, f"over-length prompt: {sum(mask)} supervised tokens within "
                                             f"max_length {cfg.max_length} (minimum {cfg.min_supervised_tokens})"))
            return
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            rejected.append(Rejected(*where, f"token ids {bad[:5]} outside the tokenizer's vocab of {vocab}"))
            return
        cols["input_ids"].append(ids)
        cols["loss_mask"].append(mask)
        cols["seq_len"].append(len(ids))
        cols["sample_id"].append(sample_id)
        for t, m in zip(ids, mask):
            counts[t] += m

    for c in convs:
        where = (c.source, c.row)
        if c.sample_id in held:
            first = next(i for i, m in enumerate(c.messages) if m["role"] == "assistant")
            prompt = render(tok, c.messages[:first], add_generation_prompt=True)
            heldout_lines.append(json.dumps({
                "sample_id": c.sample_id, "prompt_ids": tok(prompt, add_special_tokens=False)["input_ids"],
                "reference": c.messages[first]["content"]}))
            continue
        try:
            rows = encode_conversation(tok, c.messages, cfg.rows_per)
        except TemplateMismatch as e:
            rejected.append(Rejected(*where, f"template: {e}"))
            continue
        except Exception as e:  # tokenizer errors on odd input: keep the row and the reason
            rejected.append(Rejected(*where, f"tokenizer error: {type(e).__name__}: {e}"))
            continue
        for r in rows:
            sid = c.sample_id if r.turn_index is None else f"{c.sample_id}#{r.turn_index}"
            add_row(sid, r.input_ids, r.loss_mask, where)
    for p in pretok:
        add_row(p.sample_id, p.input_ids, p.loss_mask, (p.source, p.row))

    _write_outputs(out, cols, counts, heldout_lines, rejected)
    reasons: dict[str, int] = {}
    for r in rejected:
        key = r.reason.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    res = PrepareResult(
        version=version, dir=str(out.resolve()), tokenized=str((out / "tokenized").resolve()),
        token_freq=str((out / "token_freq.safetensors").resolve()), heldout=str((out / "heldout.jsonl").resolve()),
        quarantine=str((out / "quarantine.jsonl").resolve()), rows_in=rows_in, rows_out=len(cols["seq_len"]),
        rows_heldout=len(heldout_lines), rows_quarantined=len(rejected), rows_truncated=truncated,
        tokens=sum(cols["seq_len"]), supervised_tokens=sum(counts), quarantine_reasons=reasons)
    write_json(out / "prepare.json", res.model_dump())
    log(f"prepare: {res.rows_in} rows in, {res.rows_out} out, {res.rows_heldout} held out, "
        f"{res.rows_quarantined} quarantined, {res.tokens} tokens -> {out}")
    return res


def _write_outputs(out: Path, cols: dict, counts: list[int], heldout: list[str], rejected: list[Rejected]) -> None:
    import datasets
    import torch
    from safetensors.torch import save_file

    from eagle3_pipeline.store import atomic_write

    out.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")), "loss_mask": datasets.Sequence(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"), "sample_id": datasets.Value("string")})
    tmp = out / "tokenized.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_dict(cols, features=features).save_to_disk(str(tmp))
    shutil.rmtree(out / "tokenized", ignore_errors=True)
    tmp.rename(out / "tokenized")
    atomic_write(out / "token_freq.safetensors",
                 lambda p: save_file({"counts": torch.tensor(counts, dtype=torch.int64)}, str(p)))
    atomic_write_text(out / "heldout.jsonl", "".join(line + "\n" for line in heldout))
    atomic_write_text(out / "quarantine.jsonl", "".join(
        json.dumps({"source": r.source, "row": r.row, "reason": r.reason, "raw": r.raw}, default=str) + "\n"
        for r in rejected))
