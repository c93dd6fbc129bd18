"""The vocab stage: token frequencies of supervised tokens -> the draft vocabulary (d2t / t2d).

More: docs/internals.md, "vocab/stage.py".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig, VocabConfig
from eagle3_pipeline.core.stage_spec import IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import atomic_write, dir_lock, write_json
from eagle3_pipeline.data.tokenized import PrepareResult, load_tokenizer
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.results import VocabResult  # the stage's record (records/results.py)
from eagle3_pipeline.records.vocab import META_NAME, VocabError, check_vocab, d2t_name, t2d_name


def read_token_freq(path: Path, target_vocab_size: int) -> np.ndarray:
    """Counts per target id as int64[V]; raises if the file holds ids outside the target vocab."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"token frequencies {path}: file not found")
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "counts" in data:
            data = data["counts"]
        if isinstance(data, dict):
            ids = np.array([int(k) for k in data], dtype=np.int64)
            vals = np.array(list(data.values()), dtype=np.int64)
            n = int(ids.max()) + 1 if ids.size else 0
            counts = np.zeros(n, dtype=np.int64)
            counts[ids] = vals
        else:
            counts = np.asarray(data, dtype=np.int64)
    else:
        from safetensors.numpy import load_file

        try:
            tensors = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a bad file
            raise VocabError(f"token frequencies {path}: not a readable safetensors file "
                             f"({type(e).__name__}: {e})") from None
        if "counts" not in tensors:
            raise VocabError(f"token frequencies {path}: no tensor 'counts' (found {sorted(tensors)})")
        counts = tensors["counts"].astype(np.int64)
    if counts.ndim != 1:
        raise VocabError(f"token frequencies {path}: 'counts' expected shape [{target_vocab_size}], found {list(counts.shape)}")
    if counts.shape[0] > target_vocab_size:
        nz = np.nonzero(counts[target_vocab_size:])[0]
        if nz.size:
            raise VocabError(f"token frequencies {path}: counts for ids >= target vocab size {target_vocab_size} "
                             f"(e.g. id {target_vocab_size + int(nz[0])}); expected shape [{target_vocab_size}], "
                             f"found {list(counts.shape)}")
        counts = counts[:target_vocab_size]
    if (counts < 0).any():
        raise VocabError(f"token frequencies {path}: negative count for id {int(np.argmin(counts))}")
    return np.pad(counts, (0, target_vocab_size - counts.shape[0]))  # [V]


def build_vocab(cfg: VocabConfig, token_freq: Path, target_vocab_size: int, out_dir: Path,
                special_token_ids: list[int]) -> VocabResult:
    """Top-K supervised target tokens -> `d2t-K.npy`, `t2d-K.npy`, `vocab.json` in `out_dir`."""
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    k = cfg.draft_vocab_size
    if not 0 < k <= target_vocab_size:
        raise VocabError(f"vocab.draft_vocab_size={k}: must be in 1..{target_vocab_size} (the target vocab size)")
    bad = [s for s in special_token_ids if not 0 <= s < target_vocab_size]
    if bad:
        raise VocabError(f"special token ids {bad} are outside the target vocab [0, {target_vocab_size})")
    if len(set(special_token_ids)) > k:
        raise VocabError(f"{len(set(special_token_ids))} special token ids do not fit a draft vocab of {k}")
    counts = read_token_freq(token_freq, target_vocab_size)  # [V]
    total = int(counts.sum())
    if total == 0:
        raise VocabError(f"token frequencies {token_freq}: no supervised tokens counted (all counts are 0)")

    freq = {int(i): int(counts[i]) for i in np.nonzero(counts)[0]}
    by_freq = sorted(freq, key=lambda t: (-freq[t], t))
    natural = set(by_freq[:k])
    forced = sorted(s for s in set(special_token_ids) if s not in natural)
    top = max(freq.values()) + 1
    for s in special_token_ids:  # rank the special ids first (ties among them: lower id first)
        freq[int(s)] = top
    d2t_t, t2d_t = build_vocab_mappings_from_distribution(freq, k, target_vocab_size)
    d2t = d2t_t.to(torch.int64).numpy()  # [K]
    t2d = t2d_t.to(torch.bool).numpy()  # [V]
    out_dir = Path(out_dir)
    check_vocab(d2t, t2d, target_vocab_size, special_token_ids, where=f"built vocab for {out_dir}")

    def _save(arr):
        def write(p: Path):
            with open(p, "wb") as f:
                np.save(f, arr)
        return write

    with dir_lock(out_dir, f"vocab dir {out_dir}"):
        d2t_path = atomic_write(out_dir / d2t_name(k), _save(d2t))
        t2d_path = atomic_write(out_dir / t2d_name(k), _save(t2d))
        result = VocabResult(
            draft_vocab_size=k, target_vocab_size=target_vocab_size,
            coverage=float(counts[t2d].sum()) / total, distinct_tokens=len(np.nonzero(counts)[0]),
            padded=int((counts[t2d] == 0).sum()) - len([s for s in forced if counts[s] == 0]),
            forced_special=forced, d2t_path=d2t_path, t2d_path=t2d_path)
        write_json(out_dir / META_NAME, {**result.model_dump(mode="json", exclude={"dir"}),
                                         "d2t": d2t_name(k), "t2d": t2d_name(k),
                                         "special_token_ids": sorted(set(special_token_ids)),
                                         "token_freq": str(token_freq), "supervised_tokens": total})
    return result.model_copy(update={"dir": str(out_dir.resolve())})


class VocabInputs(BaseModel):
    prep: PrepareResult  # its token frequencies
    version: ExtractVersion  # the target's vocabulary size; the vocab lives in its directory


def run(cfg: PipelineConfig, inputs: VocabInputs, log: Log) -> VocabResult:
    """The stage's entry (StageSpec.run): the draft vocabulary of `vocab.draft_vocab_size` tokens."""
    tok = load_tokenizer(cfg.target)
    version = inputs.version
    return build_vocab(cfg.vocab, Path(inputs.prep.token_freq), version.dims.vocab_size,
                       version.vocab_dir(cfg.vocab.draft_vocab_size),
                       special_token_ids=[t for t in (tok.eos_token_id,) if t is not None])


RETRY = Retry(2, 5, IO, "reads token_freq and the tokenizer, writes two small files")
STAGE = StageSpec(name="vocab", run=run, result=VocabResult, failure=VocabError, retry=RETRY)
