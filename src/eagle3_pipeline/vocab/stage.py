"""The vocab stage: token frequencies of supervised tokens -> the draft vocabulary (d2t / t2d).

Reads `token_freq.safetensors` (written by prepare: one tensor `counts` int64[V'], the number of
times each target id occurs where `loss_mask` is 1; V' <= V, a shorter vector means the tokenizer is
smaller than the embedding matrix; `.json` with `{"counts": [...]}` or `{id: count}` is read too).
Writes to `out_dir`, in speculators' own conventions (its trainer and vLLM read them unchanged):
  d2t-{K}.npy  int64[K]  OFFSETS: draft index i stands for target id i + d2t[i]; ids ascending
  t2d-{K}.npy  bool[V]   True for the K target ids in the draft vocabulary
  vocab.json             what was built (sizes, coverage, special ids, file names)
  .lock                  store.dir_lock, held while these three are written (two runs never interleave them)
The top-K selection itself is speculators' `build_vocab_mappings_from_distribution` (ties broken by
lower id; fewer than K distinct tokens are padded with the lowest unused ids). Special token ids
(eos / end-of-turn) are ranked first so that the draft can always propose them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from eagle3_pipeline.core.config import VocabConfig
from eagle3_pipeline.core.errors import InputError
from eagle3_pipeline.core.stage_spec import StageSpec
from eagle3_pipeline.core.store import atomic_write, dir_lock, read_json, write_json

META_NAME = "vocab.json"


class VocabError(InputError):
    """A draft vocabulary that breaks speculators' d2t/t2d conventions; the message says where."""


class VocabResult(BaseModel):
    draft_vocab_size: int
    target_vocab_size: int
    coverage: float  # fraction of supervised (loss-masked) target tokens the draft vocab covers
    distinct_tokens: int  # target ids seen at least once in supervised positions
    padded: int  # ids added without any supervised occurrence (fewer than K distinct tokens)
    forced_special: list[int]  # special ids that were below the frequency cut and were put in anyway
    d2t_path: Path
    t2d_path: Path
    dir: str = ""  # the vocab directory (absolute)


def d2t_name(k: int) -> str:
    return f"d2t-{k}.npy"


def t2d_name(k: int) -> str:
    return f"t2d-{k}.npy"


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


def check_vocab(d2t: np.ndarray, t2d: np.ndarray, target_vocab_size: int,
                special_token_ids: list[int] | tuple[int, ...] = (), where: str = "vocab") -> None:
    """Raise VocabError unless (d2t, t2d) is a consistent speculators draft vocabulary."""
    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if d2t.ndim != 1 or d2t.dtype != np.int64:
        raise VocabError(f"{where}: d2t expected int64[K], found {d2t.dtype}{list(d2t.shape)}")
    if t2d.ndim != 1 or t2d.dtype != np.bool_:
        raise VocabError(f"{where}: t2d expected bool[{target_vocab_size}], found {t2d.dtype}{list(t2d.shape)}")
    k = d2t.shape[0]
    if t2d.shape[0] != target_vocab_size:
        raise VocabError(f"{where}: t2d expected shape [{target_vocab_size}] (target vocab), found {list(t2d.shape)}")
    if not 0 < k <= target_vocab_size:
        raise VocabError(f"{where}: d2t has {k} entries; expected 1..{target_vocab_size}")
    if int(t2d.sum()) != k:
        raise VocabError(f"{where}: t2d marks {int(t2d.sum())} target ids, expected {k} (= len(d2t))")
    target_ids = np.arange(k, dtype=np.int64) + d2t  # offsets -> target ids
    bad = np.nonzero((target_ids < 0) | (target_ids >= target_vocab_size))[0]
    if bad.size:
        i = int(bad[0])
        raise VocabError(f"{where}: draft id {i} maps to target id {int(target_ids[i])} (d2t[{i}]={int(d2t[i])}), "
                         f"outside the target vocab [0, {target_vocab_size})")
    if k > 1 and not (np.diff(target_ids) > 0).all():
        i = int(np.nonzero(np.diff(target_ids) <= 0)[0][0])
        raise VocabError(f"{where}: target ids must be strictly ascending; draft ids {i}, {i + 1} map to "
                         f"{int(target_ids[i])}, {int(target_ids[i + 1])}")
    marked = np.nonzero(t2d)[0]
    if not np.array_equal(marked, target_ids):
        i = int(np.nonzero(marked != target_ids)[0][0])
        raise VocabError(f"{where}: d2t and t2d disagree at draft id {i}: d2t says target id {int(target_ids[i])}, "
                         f"t2d's {i}-th marked id is {int(marked[i])}")
    missing = [s for s in special_token_ids if not (0 <= s < target_vocab_size and t2d[s])]
    if missing:
        raise VocabError(f"{where}: special token ids {missing} are not in the draft vocabulary")


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


def vocab_paths(vocab_dir: Path) -> tuple[Path, Path]:
    """(d2t, t2d) file paths in a vocab dir: from vocab.json, else the single d2t-*.npy / t2d-*.npy pair."""
    vocab_dir = Path(vocab_dir)
    meta = read_json(vocab_dir / META_NAME)
    if meta:
        return vocab_dir / meta["d2t"], vocab_dir / meta["t2d"]
    d2ts, t2ds = sorted(vocab_dir.glob("d2t*.npy")), sorted(vocab_dir.glob("t2d*.npy"))
    if len(d2ts) != 1 or len(t2ds) != 1:
        raise FileNotFoundError(f"vocab dir {vocab_dir}: expected {META_NAME} or exactly one d2t*.npy and one "
                                f"t2d*.npy, found {[p.name for p in d2ts + t2ds]}")
    return d2ts[0], t2ds[0]


def _load_npy(path: Path) -> np.ndarray:
    """A plain numeric .npy array; a pickle or an object array is refused, never unpickled."""
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:
        raise VocabError(f"{path}: not a plain numeric .npy array ({e}); pickled data is never loaded") from None


def load_vocab(vocab_dir: Path, target_vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64[K], t2d bool[V]) from a vocab dir, checked for consistency (never unpickles)."""
    d2t_path, t2d_path = vocab_paths(vocab_dir)
    d2t, t2d = _load_npy(d2t_path), _load_npy(t2d_path)
    meta = read_json(Path(vocab_dir) / META_NAME) or {}
    check_vocab(d2t, t2d, target_vocab_size if target_vocab_size is not None else t2d.shape[0],
                meta.get("special_token_ids", ()), where=str(vocab_dir))
    return d2t, t2d


# a stage still beside train, which reads its files (load_vocab); registry.py lists it
STAGE = StageSpec(name="vocab", run=build_vocab, result=VocabResult, failure=VocabError)
