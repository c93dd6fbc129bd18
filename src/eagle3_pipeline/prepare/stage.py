"""The prepare stage: chat rows in -> tokenized Arrow dataset, token frequencies, quarantine (its record and
readers, which the later stages use: data/tokenized.py).

More: docs/internals.md, "prepare/stage.py".
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import multiprocessing as mp
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig, PrepareConfig, SourceConfig, TargetConfig, hub_token
from eagle3_pipeline.core.digest import row_hash
from eagle3_pipeline.core.errors import DiskFull, InputError, is_disk_full
from eagle3_pipeline.core.stage_spec import IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import (
    atomic_write,
    atomic_write_text,
    content_key,
    dir_fingerprint,
    dir_lock,
    read_json,
    slug,
    within,
    write_json,
)
from eagle3_pipeline.data.chat import MaskUnavailable, TemplateMismatch, ToolCallsNotRendered, render
from eagle3_pipeline.data.formats import Conversation, RawRow, Rejected, parse_row, raw_rows, tail_warning
from eagle3_pipeline.data.mask_check import MaskDisagrees, RenderingWrong, encode_checked
from eagle3_pipeline.data.tokenized import ROW_HASHES, TOKENIZER_FILES, PrepareResult, load_tokenizer, loss_warnings
from eagle3_pipeline.records.results import RegenerateResult

# Bump when the same rows, tokenizer and settings give different chunk bytes or quarantine decisions:
# 2 = tool use, history-rewriting (thinking) templates, masks without offsets; 3 = leading assistant,
# trailing and post-empty turns trimmed, ShareGPT's chatgpt/bing/bard speakers, damaged-file tails; 5 = each row's
# hash as prepare judged it (ROW_HASHES); 6 = the rendering judged against the conversation (mask_check.RenderingWrong).
PREPARE_FORMAT = 6
ROW_COLUMNS = ("sample_id", "conv_id", "input_ids", "loss_mask", "seq_len", "truncated", "prompt_ids", "reference",
               "source", "row")


def _summed(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in (d or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def tokenization_key(cfg: PrepareConfig, target: TargetConfig, tokenizer) -> str:
    """Everything except the rows that determines a chunk's bytes."""
    tok_id = (dir_fingerprint(Path(target.tokenizer), TOKENIZER_FILES) if Path(target.tokenizer).exists()
              else f"{target.tokenizer}@{target.revision}")
    return content_key({"tokenizer": tok_id, "template": tokenizer.chat_template, "max_length": cfg.max_length,
                        "min_supervised": cfg.min_supervised_tokens, "rows_per": cfg.rows_per,
                        "prepare_format": PREPARE_FORMAT, "libraries": tokenizer_libraries()})


def tokenizer_libraries() -> dict[str, str | None]:
    """The libraries that render and tokenize a row (a fixed tokenizer bug gives new rows, never the old ones)."""
    out = {}
    for name in ("transformers", "tokenizers", "jinja2"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _chunks(src: SourceConfig, size: int, token: str | None = None) -> Iterator[list[RawRow]]:
    buf: list[RawRow] = []
    for r in raw_rows(src.path, src.limit, src.split, src.revision, token, src.on_damaged):
        buf.append(r)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def _chunk_key(tok_key: str, src: SourceConfig, rows: list[RawRow]) -> str:
    h = hashlib.sha256(f"{tok_key}|{src.format}|{src.on_damaged}|{rows[0].source}|{rows[0].row}".encode())
    for r in rows:
        h.update(len(r.blob).to_bytes(8, "little"))
        h.update(r.blob)
    return h.hexdigest()[:16]


# the quarantine reason of each rendering or mask refusal (first match: ToolCallsNotRendered is a TemplateMismatch)
_REASONS = ((ToolCallsNotRendered, "template cannot render tool calls: "), (TemplateMismatch, "template: "),
            (MaskUnavailable, "loss mask: "), (RenderingWrong, "rendering does not match the conversation: "),
            (MaskDisagrees, "loss mask disagrees with the turns' token spans: "))


def _encode_chunk(rows: list[RawRow], fmt: str, tok, cfg: PrepareConfig) -> tuple[dict[str, list], list[dict], dict]:
    """Tokenize one chunk: output columns, rejected rows, and the counts of turns dropped and trimmed."""
    cols: dict[str, list] = {k: [] for k in ROW_COLUMNS}
    rejected: list[dict] = []
    counts = {"turns_dropped": 0, "rows_trimmed": 0, "trim_reasons": {}, "mask_checks": {}}
    vocab = len(tok)

    def reject(item, reason: str, raw=None, partial: bool = False):
        rejected.append({"source": item.source, "row": item.row, "reason": reason, "raw": raw, "partial": partial})

    for raw in rows:
        item = parse_row(raw, fmt)
        if isinstance(item, Rejected):
            rejected.append({"source": item.source, "row": item.row, "reason": item.reason, "raw": item.raw,
                             "partial": False, **({"damage": item.damage} if item.damage else {})})
            continue
        prompt_ids, reference = None, None
        if isinstance(item, Conversation):
            if not getattr(tok, "chat_template", None):  # every conversation would fail: stop, don't quarantine all
                raise InputError(f"tokenizer {tok.name_or_path}: no chat template (no chat_template in "
                                 f"tokenizer_config.json, no chat_template.jinja), so the conversation at "
                                 f"{item.source} row {item.row} cannot be rendered; use a chat model's tokenizer "
                                 f"(target.tokenizer) or pre-tokenized rows")
            try:
                checked = encode_checked(tok, item.messages, cfg.rows_per, item.tools)
                encoded = [r for r, _ in checked]
                first = next(i for i, m in enumerate(item.messages) if m["role"] == "assistant")
                prompt_ids = tok(render(tok, item.messages[:first], add_generation_prompt=True, tools=item.tools),
                                 add_special_tokens=False)["input_ids"]
                reference = item.messages[first]["content"]  # None for a turn that only calls tools
            except (TemplateMismatch, MaskUnavailable, MaskDisagrees, RenderingWrong) as e:
                reject(item, next(why for kind, why in _REASONS if isinstance(e, kind)) + str(e), raw.rec)
                continue
            except Exception as e:  # tokenizer errors on odd input: keep the row and the reason
                reject(item, f"tokenizer error: {type(e).__name__}: {e}", raw.rec)
                continue
            pieces = [(item.sample_id if r.turn_index is None else f"{item.sample_id}#{r.turn_index}",
                       r.input_ids, r.loss_mask) for r in encoded]
            for _, verdict in checked:
                counts["mask_checks"][verdict] = counts["mask_checks"].get(verdict, 0) + 1
        else:
            pieces = [(item.sample_id, item.input_ids, item.loss_mask)]
        kept = 0
        for sid, ids, mask in pieces:
            truncated = len(ids) > cfg.max_length
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            why = None
            if sum(mask) < cfg.min_supervised_tokens:
                why = (f"over-length prompt: {sum(mask)} supervised tokens within max_length {cfg.max_length} "
                       f"(minimum {cfg.min_supervised_tokens})")
            elif any(not 0 <= t < vocab for t in ids):
                why = f"token ids {[t for t in ids if not 0 <= t < vocab][:5]} outside the tokenizer's vocab of {vocab}"
            if why:
                if len(pieces) > 1:
                    counts["turns_dropped"] += 1
                    reject(item, f"turn {sid}: {why}", None, partial=True)
                else:
                    reject(item, why, raw.rec)
                continue
            kept += 1
            for k, v in zip(ROW_COLUMNS, (sid, item.sample_id, ids, mask, len(ids), truncated, prompt_ids, reference,
                                          item.source, item.row)):
                cols[k].append(v)
        if pieces and not kept and len(pieces) > 1:
            reject(item, "every assistant turn dropped (see the turn entries)", raw.rec)
        elif kept and isinstance(item, Conversation) and item.trimmed:
            counts["rows_trimmed"] += 1
            for why, n in item.trimmed.items():
                counts["trim_reasons"][why] = counts["trim_reasons"].get(why, 0) + n
    return cols, rejected, counts


def _chunk(store: Path, key: str, rows: list[RawRow], fmt: str, tok, cfg: PrepareConfig) -> tuple[Path, bool]:
    """The chunk's directory, computed now (True) or found complete in the store (False)."""
    d = store / "_chunks" / key
    if (d / "chunk.json").exists():
        return d, False
    with dir_lock(d, f"prepare chunk {d}", log=None):  # a concurrent run tokenizing the same chunk
        if (d / "chunk.json").exists():
            return d, False
        return d, _write_chunk(d, rows, fmt, tok, cfg)


def _write_parquet(table, path: Path) -> None:
    """Through a file object of ours: given a path, pyarrow keeps its handle open when a write fails
    (disk full), and the deleted temporary file would hold the space until the process exits."""
    import pyarrow.parquet as pq

    with open(path, "wb") as f:
        pq.write_table(table, f)


def _write_chunk(d: Path, rows: list[RawRow], fmt: str, tok, cfg: PrepareConfig) -> bool:
    import pyarrow as pa

    cols, rejected, counts = _encode_chunk(rows, fmt, tok, cfg)
    schema = pa.schema([("sample_id", pa.string()), ("conv_id", pa.string()), ("input_ids", pa.list_(pa.int64())),
                        ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64()), ("truncated", pa.bool_()),
                        ("prompt_ids", pa.list_(pa.int64())), ("reference", pa.string()), ("source", pa.string()),
                        ("row", pa.int64())])
    table = pa.Table.from_pydict(cols, schema=schema)
    atomic_write(d / "rows.parquet", lambda p: _write_parquet(table, p))
    atomic_write_text(d / "rejected.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rejected))
    write_json(d / "chunk.json", {"rows_in": len(rows), "rows_out": table.num_rows, "rejected": len(rejected),
                                  **counts})
    return True


_WORKER: dict = {}


def _worker_init(target: TargetConfig) -> None:
    _WORKER["tok"] = load_tokenizer(target)


def _worker_chunk(args) -> tuple[Path, bool]:
    store, key, rows, fmt, cfg = args
    return _chunk(store, key, rows, fmt, _WORKER["tok"], cfg)


PATH_FIELDS = ("dir", "tokenized", "token_freq", "heldout", "quarantine")  # PrepareResult's files, in its version dir


def _complete(done: dict, out: Path, log) -> PrepareResult:
    """The complete version's record (prepare.json), its files named where the version is now: a store copied or
    moved (another machine, another mount point) reads its own files, not those of the store it was copied from."""
    log(f"prepare: version {done['version']} already complete at {out}")
    written, here = Path(done["dir"]), out.resolve()
    if written != here:
        log(f"prepare: the version was written at {written}; its files are read from {here}")
        done = {**done, **{k: str(here / Path(done[k]).relative_to(written)) for k in PATH_FIELDS
                           if Path(done[k]).is_relative_to(written)}}
    return PrepareResult(**{**done, "cached": True})


def prepare(cfg: PrepareConfig, target: TargetConfig, store_root: Path, log=print) -> PrepareResult:
    """Run the prepare stage, or return the complete version already in the store."""
    tok = load_tokenizer(target)
    tok_key = tokenization_key(cfg, target, tok)
    store = within(store_root, slug(cfg.dataset))
    jobs = ((store, _chunk_key(tok_key, src, rows), rows, src.format, cfg)
            for src in cfg.sources for rows in _chunks(src, cfg.chunk_rows, hub_token(target)))
    if cfg.num_proc > 1:

        with mp.get_context("spawn").Pool(cfg.num_proc, _worker_init, (target,)) as pool:
            done = list(pool.imap(_worker_chunk, jobs))
    else:
        done = [_chunk(store, key, rows, fmt, tok, c) for store, key, rows, fmt, c in jobs]
    chunk_dirs = [d for d, _ in done]
    computed = sum(fresh for _, fresh in done)
    heldout = cfg.heldout_rows if cfg.heldout_fraction is None else [cfg.heldout_rows, cfg.heldout_fraction]
    version = content_key({"tok": tok_key, "chunks": [d.name for d in chunk_dirs], "heldout": heldout})
    out = store / version
    done = read_json(out / "prepare.json")
    if done is not None:
        return _complete(done, out, log)
    with dir_lock(out, f"prepare version {version}", log):
        done = read_json(out / "prepare.json")  # a concurrent run may have finished it while we waited
        if done is not None:
            return _complete(done, out, log)
        log(f"prepare: {len(chunk_dirs)} chunks, {computed} tokenized now, {len(chunk_dirs) - computed} reused")
        res = _assemble(cfg, chunk_dirs, computed, out, version, len(tok))
    log(f"prepare: {res.rows_in} rows in, {res.rows_out} out, {res.rows_heldout} held out, "
        f"{res.rows_quarantined} quarantined, {res.tokens} tokens -> {out}")
    if res.turns_trimmed:
        log(f"prepare: {res.rows_trimmed} kept rows lost {res.turns_trimmed} turns: " +
            ", ".join(f"{why} ({n})" for why, n in res.trim_reasons.items()))
    for w in res.source_warnings:
        log(f"prepare: WARNING {w}")
    for d in res.damaged_sources:
        log(f"prepare: WARNING damaged source {d['source']}: kept its {d['records_complete']} complete records, "
            f"lost {d['bytes_lost']} bytes after byte {d['good_end']} ({d['what']})")
    return res


def heldout_hash(conv_id: str) -> float:
    """sha256 of a conversation id as a number in [0, 1): below prepare.heldout_fraction = held out."""
    return int(hashlib.sha256(conv_id.encode()).hexdigest()[:15], 16) / 16 ** 15


def _assemble(cfg: PrepareConfig, chunk_dirs: list[Path], computed: int, out: Path, version: str,
              vocab: int) -> PrepareResult:
    """Concatenate chunks; drop duplicate ids (later ones quarantined); pick the held-out conversations."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    metas = [read_json(d / "chunk.json") for d in chunk_dirs]
    rejected = [json.loads(line) for d in chunk_dirs for line in (d / "rejected.jsonl").read_text().splitlines()]
    table = pa.concat_tables([pq.read_table(d / "rows.parquet") for d in chunk_dirs]) if chunk_dirs else None
    table = _without_duplicates(table, rejected)
    table, held, heldout_lines = _hold_out(cfg, table)
    n_out = table.num_rows if table is not None else 0
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")), "loss_mask": datasets.Sequence(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"), "sample_id": datasets.Value("string")})
    # The Arrow columns as they are (no Python lists), cast to the features' schema.
    arrow = (pa.table({k: table[k] for k in features}).cast(features.arrow_schema).combine_chunks() if n_out
             else features.arrow_schema.empty_table())
    counts = np.zeros(vocab, dtype=np.int64)
    if n_out:
        ids = pc.list_flatten(table["input_ids"]).to_numpy()
        mask = pc.list_flatten(table["loss_mask"]).to_numpy()
        counts = np.bincount(ids, weights=mask, minlength=vocab).astype(np.int64)[:vocab]
    _save_tokenized(out, version, arrow, features)
    atomic_write(out / "token_freq.safetensors", lambda p: save_file({"counts": torch.from_numpy(counts)}, str(p)))
    atomic_write_text(out / "heldout.jsonl", "".join(line + "\n" for line in heldout_lines))
    atomic_write_text(out / "quarantine.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rejected))
    full = [r for r in rejected if not r.get("partial")]
    reasons: dict[str, int] = {}
    for r in rejected:
        key = r["reason"].split(":")[0] if not r.get("partial") else "turn dropped"
        reasons[key] = reasons.get(key, 0) + 1
    if not n_out and not heldout_lines:  # nothing to train on: fail here, not in extract (not marked complete)
        rows_in = sum(m["rows_in"] for m in metas)
        top = ", ".join(f"{k} ({v})" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
        raise InputError(f"prepare: no usable rows: the sources hold {rows_in} rows" +
                         (f", all quarantined ({top}); see {out / 'quarantine.jsonl'}" if rows_in else ""))
    trims = _summed(m.get("trim_reasons", {}) for m in metas)
    seq = arrow["seq_len"].to_pylist()
    res = PrepareResult(
        version=version, dir=str(out.resolve()), tokenized=str((out / "tokenized").resolve()),
        token_freq=str((out / "token_freq.safetensors").resolve()), heldout=str((out / "heldout.jsonl").resolve()),
        quarantine=str((out / "quarantine.jsonl").resolve()), rows_in=sum(m["rows_in"] for m in metas),
        rows_out=n_out, rows_out_sources=len(set(zip(table["source"].to_pylist(), table["row"].to_pylist()))) if n_out else 0,
        rows_heldout=len(held), rows_quarantined=len(full),
        rows_truncated=int(sum(table["truncated"].to_pylist())) if n_out else 0,
        turns_dropped=sum(m["turns_dropped"] for m in metas), rows_trimmed=sum(m.get("rows_trimmed", 0) for m in metas),
        turns_trimmed=sum(trims.values()), trim_reasons=trims, mask_checks=_summed(m.get("mask_checks") for m in metas),
        damaged_sources=[r["damage"] for r in rejected if r.get("damage")],
        source_warnings=[w for src in cfg.sources if (w := tail_warning(src.path))],
        tokens=int(sum(seq)), supervised_tokens=int(counts.sum()),
        quarantine_reasons=reasons, length_histogram=_length_histogram(seq),
        chunks_total=len(chunk_dirs), chunks_computed=computed)
    return _publish(out, res, arrow)


def _without_duplicates(table, rejected: list[dict]):
    """`table` (pyarrow, or None: no chunks) without the rows whose conversation id came before; each such
    source row is added to `rejected` once, naming where the id was first."""
    import pyarrow as pa

    if table is None:
        return None
    keep_idx, owner, dup_rows = [], {}, set()
    where = list(zip(table["source"].to_pylist(), table["row"].to_pylist()))
    for i, (cid, w) in enumerate(zip(table["conv_id"].to_pylist(), where)):
        first = owner.setdefault(cid, w)
        if first != w:
            if w not in dup_rows:
                dup_rows.add(w)
                rejected.append({"source": w[0], "row": w[1], "reason": f"duplicate id {cid!r} (first at {first[0]} "
                                 f"row {first[1]})", "raw": None, "partial": False})
            continue
        keep_idx.append(i)
    return table.take(pa.array(keep_idx, pa.int64()))


def _hold_out(cfg: PrepareConfig, table) -> tuple[object, set[str], list[str]]:
    """(`table` without the held-out conversations, their ids, heldout.jsonl's lines): the first
    `heldout_rows` conversations by id hash, or with `heldout_fraction` every conversation below it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    heldout_lines, held = [], set()
    if table is None or not cfg.heldout_rows:
        return table, held, heldout_lines
    convs = {}
    for cid, p, ref in zip(table["conv_id"].to_pylist(), table["prompt_ids"].to_pylist(), table["reference"].to_pylist()):
        if p is not None and cid not in convs:
            convs[cid] = (p, ref)
    ranked = sorted(convs, key=lambda c: hashlib.sha256(c.encode()).hexdigest())
    if cfg.heldout_fraction is not None:  # a function of the conversation alone: stable across refreshes
        ranked = [c for c in ranked if heldout_hash(c) < cfg.heldout_fraction]
        held.update(ranked)  # all of them leave training; heldout.jsonl lists the first heldout_rows
    for cid in ranked[: cfg.heldout_rows]:
        held.add(cid)
        heldout_lines.append(json.dumps({"sample_id": cid, "prompt_ids": convs[cid][0], "reference": convs[cid][1]}))
    return table.filter(pc.invert(pc.is_in(table["conv_id"], pa.array(sorted(held), pa.string())))), held, heldout_lines


def _save_tokenized(out: Path, version: str, arrow, features) -> None:
    """`<out>/tokenized` (save_to_disk, torch format) from the Arrow table, written aside and renamed."""
    import datasets
    from datasets.table import InMemoryTable

    n_out = arrow.num_rows
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tokenized.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # The dataset gets the version's own key as its fingerprint: otherwise `datasets` hashes the whole table
    # through dill on construction (a pass over every token, and dill's `dis` output landed in the flow log).
    ds = datasets.Dataset(InMemoryTable(arrow), info=datasets.DatasetInfo(features=features),
                          fingerprint=hashlib.sha256(f"eagle3-prepare:{version}:{n_out}".encode()).hexdigest()[:16])
    ds.set_format(type="torch")  # speculators' convention (its prepare-data does the same)
    try:
        ds.save_to_disk(str(tmp))
    except OSError as e:
        if not is_disk_full(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFull(f"{out / 'tokenized'}: write failed, the disk is full ({type(e).__name__}: {e}); "
                       f"nothing was written under this name", e.errno) from e
    shutil.rmtree(out / "tokenized", ignore_errors=True)
    tmp.rename(out / "tokenized")


def _length_histogram(seq: list[int]) -> dict[str, int]:
    """Rows per length bucket (0-63, 64-127, ..., >=8192), the empty buckets left out."""
    edges = [0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 1 << 30]
    hist = {f"{a}-{b - 1}" if b < 1 << 30 else f">={a}": sum(a <= s < b for s in seq) for a, b in zip(edges, edges[1:])}
    return {k: v for k, v in hist.items() if v}


def _publish(out: Path, res: PrepareResult, arrow) -> PrepareResult:
    """ROW_HASHES, then prepare.json (the version is complete from then on)."""
    from safetensors.numpy import save_file

    atomic_write(out / ROW_HASHES, lambda p: save_file({"hashes": _judged_row_hashes(arrow)}, str(p)))
    res.row_hashes = str((out / ROW_HASHES).resolve())
    write_json(out / "prepare.json", res.model_dump())
    return res


def _judged_row_hashes(arrow):
    """digest.row_hash of every row as prepare judged it (its mask checked twice), as uint8 [N, 8]: verify
    compares the rows train will read with these, so a row changed after prepare is named."""
    if not arrow.num_rows:
        return np.zeros((0, 8), dtype=np.uint8)
    ids, masks = (arrow[c].combine_chunks() for c in ("input_ids", "loss_mask"))
    offs = ids.offsets.to_numpy() - ids.offsets.to_numpy()[0]
    iv, mv = ids.flatten().to_numpy(), masks.flatten().to_numpy()
    return np.frombuffer(b"".join(bytes.fromhex(row_hash(iv[a:b], mv[a:b])) for a, b in zip(offs, offs[1:])),
                         dtype=np.uint8).reshape(-1, 8).copy()


class PrepareInputs(BaseModel):
    regenerated: RegenerateResult | None = None  # the regenerate stage's rows, read instead of prepare.sources


def run(cfg: PipelineConfig, inputs: PrepareInputs, log: Log) -> PrepareResult:
    """The stage's entry (StageSpec.run): tokenize prepare.sources, or the regenerated rows."""
    prep_cfg = cfg.prepare
    if (regen := inputs.regenerated) is not None:
        prep_cfg = cfg.prepare.model_copy(update={"sources": regen.sources()})
        log(f"prepare: reading the regenerated rows of version {regen.version} ({regen.rows_dir})")
    res = prepare(prep_cfg, cfg.target, Path(cfg.store), log=log)
    for w in loss_warnings(res, cfg.prepare):
        log(f"prepare warning: {w}")
    return res


RETRY = Retry(2, 30, IO,
              "reads sources (files, fsspec, the hub) and writes the store; a retry reuses every content-keyed "
              "chunk already tokenized")
STAGE = StageSpec(name="prepare", run=run, result=PrepareResult, failure=InputError, retry=RETRY)
