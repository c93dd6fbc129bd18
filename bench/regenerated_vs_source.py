"""The dataset's own answers against the target's regenerated answers, at equal training tokens.

Reads two finished runs of one target, dataset and prompt set (their report.json): one trained on the
source's answers, one with `regenerate.enabled` (the target answered the same conversations). Prints the
training data of each (rows, tokens, tokens under the loss mask, answers cut short, rows cut at
prepare.max_length) and τ overall, per turn and per category side by side, with regenerated - source.

Equal training tokens is the comparison that means something: a draft's τ grows with its data (report.md's
τ-vs-data curve). When the two runs' supervised tokens differ by more than --tolerance, the source's τ is
also read off the store's history curve of source-answer runs (log-linear between the two runs nearest the
regenerated run's size), and the table says which number it compares.

The two runs (SmolLM2 on ShareGPT, 2 cores: ~30 min each at 300 conversations):
  .venv/bin/eagle3 run -c configs/smollm2-sharegpt.yaml --output-dir runs --set regenerate.enabled=true \\
      --set 'prepare.sources=[{path: ..., format: sharegpt, limit: N, on_damaged: keep_complete}]'
  .venv/bin/eagle3 run -c configs/smollm2-sharegpt.yaml --output-dir runs --set 'prepare.sources=[... limit: M ...]'
with M chosen so that both train on about the same supervised tokens.
Usage: .venv/bin/python bench/regenerated_vs_source.py --source runs/<id> --regenerated runs/<id>
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _get(stage: dict, key: str):
    return stage.get(key) if stage.get(key) is not None else (stage.get("details") or {}).get(key)


def summary(run: Path) -> dict:
    rep = json.loads((run / "report.json").read_text())
    st = rep["stages"]
    pr, ev, rg, tr = st.get("prepare") or {}, st.get("evaluate") or {}, st.get("regenerate") or {}, st.get("train") or {}
    cats = _get(ev, "per_category") or {}
    cut = _get(rg, "answers_cut") or {}
    return {"run": run.name, "regenerated": bool(rg), "rows": _get(pr, "rows_out"), "tokens": _get(pr, "tokens"),
            "supervised": _get(pr, "supervised_tokens"), "rows_cut": _get(pr, "rows_truncated"),
            "answers": _get(rg, "turns_regenerated"), "answers_cut": sum(cut.values()) if rg else None,
            "answers_repeating": _get(rg, "answers_repeating") if rg else None,
            "epochs": _get(tr, "epochs_done"), "val_loss": _get(tr, "val_loss"), "acc1": _first(_get(tr, "final_acc")),
            "tau": _get(ev, "acceptance_length"), "tau_untrained": _get(ev, "acceptance_length_untrained"),
            "per_turn": _get(ev, "acceptance_length_per_turn") or {},
            "per_category": {c: v.get("acceptance_length") for c, v in cats.items() if isinstance(v, dict)},
            "ngram": (_get(ev, "baseline_ngram") or {}).get("tokens_per_step"),
            "suffix": (_get(ev, "baseline_suffix") or {}).get("tokens_per_step"),
            "history": history(rep)}


def history(rep: dict) -> list[dict]:
    """The store's history of runs like this one (same prompt set, k and kind of answers), as it is now."""
    from eagle3_pipeline.report.decision import history_path, read_history

    cfg, curve = rep.get("config") or {}, (rep.get("decision") or {}).get("curve") or []
    if not curve or not cfg.get("store"):
        return curve
    mine = next((p for p in curve if p["run_id"] == rep.get("run_id")), curve[0])
    path = history_path(Path(cfg["store"]), cfg["prepare"]["dataset"], cfg["target"]["model"])
    return [p.model_dump() for p in read_history(path)
            if (p.prompts, p.k, p.data) == (mine.get("prompts"), mine.get("k"), mine.get("data", "source"))]


def _first(v):
    """The first draft position's accuracy (final_acc is one number per position)."""
    return v[0] if isinstance(v, list) and v else v


def on_curve(curve: list[dict], tokens: int) -> float | None:
    """τ of the source-answer runs read off their curve at `tokens` supervised tokens (log-linear between the
    two nearest runs, or beyond them along their slope); None: fewer than two sizes."""
    pts = sorted({(p["supervised_tokens"], p["tau"]) for p in curve if p.get("supervised_tokens")})
    if len(pts) < 2:
        return None
    pts.sort(key=lambda p: abs(math.log2(p[0] / tokens)))
    (x0, y0), (x1, y1) = sorted(pts[:2])
    if x0 == x1:
        return None
    return y0 + (y1 - y0) * (math.log2(tokens) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))


def _f(v, digits: int = 3) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return "–" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, required=True, help="run dir trained on the dataset's own answers")
    ap.add_argument("--regenerated", type=Path, required=True, help="run dir trained on the target's answers")
    ap.add_argument("--tolerance", type=float, default=0.05, help="supervised tokens closer than this are equal")
    ap.add_argument("--json", type=Path, help="also write the comparison here")
    ap.add_argument("--any-runs", action="store_true", help="compare two runs whatever their data (e.g. regenerated "
                    "rows filtered by hand and read as a source)")
    a = ap.parse_args()
    s, r = summary(a.source), summary(a.regenerated)
    if not a.any_runs and (s["regenerated"] or not r["regenerated"]):
        raise SystemExit("--source must be a run without regenerate, --regenerated one with it")
    con = Console(width=160)
    t = Table(title="training data")
    for col in ("arm", "run", "rows", "tokens", "supervised", "rows cut at max_length", "answers", "cut short",
                "looping", "held-out loss (own data)", "acc@1"):
        t.add_column(col, justify="right" if col not in ("arm", "run") else "left")
    for name, x in (("source", s), ("regenerated", r)):
        t.add_row(name, x["run"], _f(x["rows"]), _f(x["tokens"]), _f(x["supervised"]), _f(x["rows_cut"]),
                  _f(x["answers"]), _f(x["answers_cut"]), _f(x["answers_repeating"]), _f(x["val_loss"], 3),
                  _f(x["acc1"], 3))
    con.print(t)
    ratio = r["supervised"] / s["supervised"] if s["supervised"] and r["supervised"] else None
    equal = ratio is not None and abs(ratio - 1) <= a.tolerance
    src_tau, how = s["tau"], "the source run"
    if not equal and ratio is not None:
        read = on_curve(s["history"], r["supervised"])
        if read is not None:
            src_tau, how = read, f"the source curve at {r['supervised']:,} supervised tokens"
    con.print(f"supervised tokens regenerated ÷ source: {_f(ratio)} ({'equal' if equal else 'NOT equal'} within "
              f"{a.tolerance:.0%}); source τ compared: {how}")
    t = Table(title="τ (temperature 0) and the training-free options, tokens per target step")
    for col in ("row", "source", "regenerated", "regenerated - source"):
        t.add_column(col, justify="left" if col == "row" else "right")
    rows = [("τ overall", src_tau, r["tau"]), ("τ untrained", s["tau_untrained"], r["tau_untrained"])]
    rows += [(f"τ {k}", s["per_turn"].get(k), r["per_turn"].get(k)) for k in sorted(set(s["per_turn"]) | set(r["per_turn"]))]
    rows += [(f"τ {c}", s["per_category"].get(c), r["per_category"].get(c))
             for c in sorted(set(s["per_category"]) | set(r["per_category"]))]
    rows += [("n-gram", s["ngram"], r["ngram"]), ("suffix decoding", s["suffix"], r["suffix"])]
    for name, x, y in rows:
        diff = y - x if isinstance(x, float) and isinstance(y, float) else None
        t.add_row(name, _f(x), _f(y), f"{diff:+.3f}" if diff is not None else "–")
    con.print(t)
    if a.json:
        a.json.write_text(json.dumps({"source": s, "regenerated": r, "supervised_ratio": ratio, "equal": equal,
                                      "source_tau_compared": src_tau, "how": how}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
