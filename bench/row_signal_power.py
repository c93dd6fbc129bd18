"""Detection power and false flags of the per-row signals (verify/row_signal.py's surprise, verify/prediction.py's
hit rate) under forwards computed wrongly, on a target run with transformers (no engine: every mode, every row).

`python bench/row_signal_power.py CONFIG MODEL LIMIT EVERY OUT_JSON [set ...]` prepares LIMIT conversations with
CONFIG (prepare only), runs every row's clean forward, and for one row in EVERY (by a hash of its ids, as
tests/helpers/forward_corruption.py picks them) each corrupted forward:
  reversed  positions in reverse order                     (wrong positions)
  restart   positions counted again from 0 halfway through  (wrong positions)
  context   the first quarter of the input ids reversed      (wrong context, as forward_corruption's "context")
  kv        the second half attends to another row's first half at the same positions (wrong KV: another
            request's cache blocks), the first half as computed cleanly
Each token's score is what verify reads (FinalLayerCheck.next_gaps: logit(next) - logit(top1); top-2 hits), the
bigram difficulty and the judgment are row_signal's own. Per mode: the share of corrupted rows flagged (power) and
of clean rows flagged (false flags), at the shipped limits and at a few others. Writes OUT_JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

MODES = ("reversed", "restart", "context", "kv")
LIMITS = (3.0, 3.5, 4.0, 5.0)


def _bad(ids, every: int) -> bool:
    import numpy as np

    blob = np.asarray(ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") % every == 0


def _scores(logits, ids):
    """(gap sum, gap sum of squares, count), (top-2 hits, scored) of one row from its logits [T, V]."""
    import torch

    nxt = torch.as_tensor(ids[1:])
    lg = logits[:-1].float()
    gap = lg.gather(-1, nxt[:, None])[:, 0] - lg.max(-1).values
    hits = (lg.topk(2, -1).indices == nxt[:, None]).any(-1)
    g = gap.double()
    return (float(g.sum()), float((g * g).sum()), len(g)), (int(hits.sum()), len(nxt))


def _forward(model, ids, mode: str | None, other=None):
    import torch

    T = len(ids)
    x = torch.as_tensor(ids)[None]
    pos = torch.arange(T)[None]
    with torch.no_grad():
        if mode == "reversed":
            pos = pos.flip(-1)
        elif mode == "restart":
            h = T // 2
            pos = torch.cat([pos[:, :T - h], torch.arange(h)[None]], -1)
        elif mode == "context":
            q = max(2, T // 4)
            x = x.clone()
            x[0, :q] = x[0, :q].flip(0)
        elif mode == "kv":
            h = T // 2
            clean = model(input_ids=x, position_ids=pos).logits[0]
            mixed = torch.cat([torch.as_tensor(other[:h]), x[0, h:]])[None]
            wrong = model(input_ids=mixed, position_ids=pos).logits[0]
            return torch.cat([clean[:h], wrong[h:]])
        return model(input_ids=x, position_ids=pos).logits[0]


def main(config: str, model_dir: str, limit: str, every: str, out: str, *sets: str) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.stages import stage_prepare
    from eagle3_pipeline.verify import prediction, row_signal

    torch.manual_seed(0)
    base = load_config(ROOT / config)
    per = int(limit) // len(base.prepare.sources)
    srcs = ", ".join(f"{{path: '{s.path}', limit: {per}, format: {s.format}, on_damaged: {s.on_damaged}}}"
                     for s in base.prepare.sources)
    cfg = load_config(ROOT / config, [f"store={Path(out).parent / 'store'}", f"target.model={model_dir}",
                                      f"prepare.sources=[{srcs}]", "prepare.heldout_rows=4", *sets])
    prep = stage_prepare(cfg, log=lambda *_: None)
    rows = [list(map(int, r)) for r in datasets.load_from_disk(prep.tokenized)["input_ids"]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 trust_remote_code=cfg.target.trust_remote_code).eval()
    t0 = time.time()
    clean = [_scores(_forward(model, ids, None), ids) for ids in rows]
    bad = [i for i, ids in enumerate(rows) if _bad(ids, int(every))]
    other = {i: _other(rows, i) for i in bad}
    wrong = {m: {i: _scores(_forward(model, rows[i], m, other[i]), rows[i]) for i in bad} for m in MODES}
    secs = time.time() - t0
    difficulty = [d for d, _ in row_signal.bigram_difficulty(rows)]
    res = {"config": config, "rows": len(rows), "bad_rows": len(bad), "tokens": sum(map(len, rows)),
           "forward_s": round(secs, 1), "modes": {}}
    for mode in (None, *MODES):
        sc = [wrong[mode][i] if mode and i in wrong[mode] else clean[i] for i in range(len(rows))]
        entry = {}
        for lim in LIMITS:
            fl, summ = row_signal.judge([(i, sc[i][0], difficulty[i]) for i in range(len(rows))], lim)
            hp, _ = prediction.judge([(i, *sc[i][1]) for i in range(len(rows))], lim)
            entry[f"z>{lim:g}"] = _rates(fl, hp, bad if mode else [], len(rows))
        entry["slope"], entry["spread"] = summ.slope, summ.spread
        if mode:
            zs, _ = row_signal.judge([(i, sc[i][0], difficulty[i]) for i in range(len(rows))], 0.0)
            entry["bad_z"] = sorted(round(zs.get(i, 0.0), 2) for i in bad)
        res["modes"][mode or "clean"] = entry
    Path(out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


def _other(rows: list, i: int) -> list:
    """Another request whose first half is as long as row i's."""
    n = len(rows)
    return next(rows[(i + k) % n] for k in range(1, n) if len(rows[(i + k) % n]) >= len(rows[i]) // 2)


def _rates(surprise: dict, hits: dict, bad: list[int], n: int) -> dict:
    clean_n = n - len(bad)
    b = set(bad)
    return {"surprise_power": round(len(b & set(surprise)) / len(b), 3) if b else None,
            "surprise_false": round(len(set(surprise) - b) / clean_n, 4),
            "hitrate_power": round(len(b & set(hits)) / len(b), 3) if b else None,
            "hitrate_false": round(len(set(hits) - b) / clean_n, 4)}


if __name__ == "__main__":
    main(*sys.argv[1:])
