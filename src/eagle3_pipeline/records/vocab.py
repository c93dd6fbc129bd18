"""A draft vocabulary's files as the stages read them (the vocab stage writes them: vocab/stage.py): their names,
`check_vocab` (speculators' d2t/t2d conventions) and `load_vocab`, which never unpickles.

  d2t-{K}.npy  int64[K]  OFFSETS: draft index i stands for target id i + d2t[i]; ids ascending
  t2d-{K}.npy  bool[V]   True for the K target ids in the draft vocabulary
  vocab.json             what was built (sizes, coverage, special ids, file names)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_pipeline.core.errors import InputError
from eagle3_pipeline.core.store import read_json

META_NAME = "vocab.json"


class VocabError(InputError):
    """A draft vocabulary that breaks speculators' d2t/t2d conventions; the message says where."""


def d2t_name(k: int) -> str:
    return f"d2t-{k}.npy"


def t2d_name(k: int) -> str:
    return f"t2d-{k}.npy"


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
