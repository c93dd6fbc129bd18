"""Worth training? The report's first lines: per prompt category, the trained draft's τ against the best
training-free option measured in the same evaluation (vLLM's n-gram and suffix decoding, tokens per target
step counting every decode step, τ's convention), and the τ-vs-data curve of this dataset and target from
the store's history (one row per run: store/<dataset>/history/<target>.jsonl).

More: docs/internals.md, "report/decision.py".
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.store import atomic_write_text, slug
from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.records.evaluation import EvaluateReport
from eagle3_pipeline.records.results import TrainResult
from eagle3_pipeline.report.loose import loose

BASELINES = (("baseline_ngram", "n-gram", "tokens_per_step_ngram"),
             ("baseline_suffix", "suffix decoding", "tokens_per_step_suffix"))


class DecisionRow(BaseModel):
    """One category (or all prompts): the trained draft against the best training-free option."""
    prompts: int | None = None
    trained: float | None  # τ of the trained draft, temperature 0
    best_free: float | None  # tokens per target step of the best training-free baseline
    best_free_method: str | None  # "n-gram" or "suffix decoding", with its implementation where recorded
    margin: float | None  # trained - best_free
    beats: bool | None  # None: one side was not measured


class CurvePoint(BaseModel):
    """One run of this dataset and target, as the store's history keeps it."""
    run_id: str
    train_tokens: int  # tokens the trainer read per epoch: the training data's size
    tau: float
    best_free: float | None = None
    prompts: str | None = None  # the evaluation prompt set's source: τ compares only on the same set
    k: int | None = None
    data: str = "source"  # "source": the dataset's own answers; "regenerated": the target's (one curve each)
    supervised_tokens: int | None = None  # of train_tokens, those under the loss mask (prepare's count)
    implementation: str | None = None  # series key: vLLM version and runner, suffix backend (None: not recorded)


class Decision(BaseModel):
    """report.json `decision`."""
    overall: DecisionRow
    per_category: dict[str, DecisionRow] = {}
    curve: list[CurvePoint] = []  # this run and the earlier runs on the same prompts, k and implementation
    implementation: str | None = None  # this run's series key (series_key)
    other_curves: dict[str, list[CurvePoint]] = {}  # the same prompts and k on other implementations, one per key
    tau_per_doubling: float | None = None  # least-squares slope of τ against log2(training tokens); None: < 2 sizes
    says: str  # the decision in one sentence


def _row(trained, options: dict[str, float | None], prompts=None) -> DecisionRow:
    have = {m: v for m, v in options.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    method = max(have, key=have.get) if have else None
    best = have.get(method) if method else None
    ok = isinstance(trained, (int, float)) and math.isfinite(trained)
    margin = trained - best if ok and best is not None else None
    return DecisionRow(prompts=prompts, trained=trained if ok else None, best_free=best, best_free_method=method,
                       margin=None if margin is None else round(margin, 4),
                       beats=None if margin is None else margin > 0)


def decide(evaluate: dict | None, curve: list[CurvePoint]) -> Decision | None:
    """The decision from report.json's evaluate entry (contract keys and details alike) and the curve."""
    if not isinstance(evaluate, dict):
        return None
    ev = _record(EvaluateReport, evaluate)
    named = {key: _named(name, getattr(ev, key)) for key, name, _ in BASELINES if getattr(ev, key) is not None}
    free = {named[key]: getattr(ev, key).tokens_per_step for key in named}
    overall = _row(ev.acceptance_length, free)
    cats = {str(c): _row(v.acceptance_length, {named[key]: getattr(v, col) for key, _, col in BASELINES
                                               if key in named}, v.prompts)
            for c, v in (ev.per_category or {}).items() if v is not None}
    key = series_key(ev)
    mine, others = split_series(curve, key)
    slope = per_doubling(mine)
    says = _says(overall, cats, slope, len(mine))
    if others:
        says += (f"; {sum(map(len, others.values()))} run(s) measured on another implementation "
                 f"({'; '.join(others)}) are kept on their own curve(s), not this one")
    return Decision(overall=overall, per_category=cats, curve=mine, tau_per_doubling=slope, says=says,
                    implementation=key, other_curves=others)


NOT_RECORDED = "implementation not recorded"


def _named(name: str, baseline) -> str:
    """A baseline's name with the implementation that measured it (vLLM version; the suffix decoding backend)."""
    impl = baseline.implementation
    if impl is None:
        return name
    backend = impl.backend
    on = f"vLLM {impl.vllm or '?'}"
    return f"{name}, {backend} on {on}" if backend and backend != "vllm" else f"{name}, {on}"


def series_key(ev) -> str | None:
    """The implementation an evaluation's numbers come from, as one key: the vLLM version(s) and runner(s) of its
    draft and baseline engines, and the suffix decoding backend (None: nothing recorded). `ev`: evaluate's record
    (EvaluateReport, loose)."""
    impls = {name: getattr(ev, key).implementation for key, name in
             (("trained", "draft"), ("baseline_ngram", "n-gram"), ("baseline_suffix", "suffix"))
             if getattr(ev, key) is not None}
    impls = {k: v for k, v in impls.items() if v is not None}
    if not impls:
        return None
    engines = sorted({f"vLLM {v.vllm or '?'}" + (f" {v.runner.upper()}" if v.runner else "")
                      for v in impls.values()})
    key = ", ".join(engines)
    if "suffix" in impls:
        backend = impls["suffix"].backend or "?"
        key += f"; suffix: {'vLLM native' if backend == 'vllm' else backend}"
    return key


def split_series(curve: list[CurvePoint], key: str | None) -> tuple[list[CurvePoint], dict[str, list[CurvePoint]]]:
    """(the points of implementation `key`, {other key: its points}); a point without a key is its own series."""
    mine = [p for p in curve if p.implementation == key]
    others: dict[str, list[CurvePoint]] = {}
    for p in curve:
        if p.implementation != key:
            others.setdefault(p.implementation or NOT_RECORDED, []).append(p)
    return mine, others


def per_doubling(curve: list[CurvePoint]) -> float | None:
    """Least-squares slope of τ against log2(training tokens) over the runs (None: fewer than 2 data sizes)."""
    pts = [(math.log2(p.train_tokens), p.tau) for p in curve if p.train_tokens > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts), 4)


def _says(overall: DecisionRow, cats: dict[str, DecisionRow], slope: float | None, runs: int) -> str:
    if overall.trained is None:
        return "no trained τ was measured"
    if overall.best_free is None:
        return f"trained τ {overall.trained:.3f}; no training-free baseline was measured to compare with"
    won = [c for c, r in cats.items() if r.beats]
    lost = [c for c, r in cats.items() if r.beats is False]
    head = (f"the trained draft {'beats' if overall.beats else 'does not beat'} the best training-free option "
            f"({overall.best_free_method}, {overall.best_free:.3f} tokens per target step) with τ {overall.trained:.3f} "
            f"({overall.margin:+.3f})")
    if cats and len(cats) > 1:
        head += f"; it wins {len(won)} of {len(won) + len(lost)} categories" + (
            f" and loses {', '.join(lost[:4])}" + (" …" if len(lost) > 4 else "") if lost else "")
    if slope is not None:
        head += f"; over {runs} runs τ grows {slope:+.3f} per doubling of the training data"
        if not overall.beats and slope > 0:
            gap = -overall.margin / slope
            head += f", so about {gap:.1f} more doublings would reach the best training-free option"
    return head


# ------------------------------------------------------------------ the store's history

def history_path(store: Path, dataset: str, model: str) -> Path:
    """store/<dataset>/history/<target slug>.jsonl: one line per run that trained and evaluated a draft."""
    return Path(store) / dataset / "history" / f"{slug(model)}.jsonl"


def read_history(path: Path) -> list[CurvePoint]:
    """Every readable line of the history (a line cut off by a crash is skipped)."""
    out = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                out.append(CurvePoint.model_validate_json(line))
            except ValueError:
                continue
    return out


def record_run(path: Path, point: CurvePoint) -> list[CurvePoint]:
    """Add (or replace: a run reported again) this run's point; returns the runs comparable with it (same prompt
    set, k and kind of answers), by training tokens, of every implementation (`decide` splits them by it)."""
    rows = [p for p in read_history(path) if p.run_id != point.run_id] + [point]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path), "".join(p.model_dump_json() + "\n" for p in rows))
    same = [p for p in rows if (p.prompts, p.k, p.data) == (point.prompts, point.k, point.data)]
    return sorted(same, key=lambda p: (p.train_tokens, p.run_id))


def _flat(entry: dict | None) -> dict:
    """A report entry's contract keys and details in one mapping (a contract key's value wins unless None)."""
    entry = entry or {}
    return {**(entry.get("details") or {}), **{k: v for k, v in entry.items() if v is not None and k != "details"}}


def _record(record: type[BaseModel], entry: dict | None):
    """A report.json entry as its stage's own record (e.g. EvaluateReport), loose: every field optional."""
    return loose(record).model_validate(_flat(entry))


def curve_point(run_id: str, stages: dict) -> CurvePoint | None:
    """This run's point from its report entries (None: no trained draft was evaluated)."""
    ev = _record(EvaluateReport, stages.get("evaluate"))
    tr, pr = _record(TrainResult, stages.get("train")), _record(PrepareResult, stages.get("prepare"))
    tau, tokens, epochs = ev.acceptance_length, tr.tokens, tr.epochs_done or 1
    if not isinstance(tau, (int, float)) or not isinstance(tokens, int) or tokens <= 0:
        return None
    free = [getattr(ev, key).tokens_per_step for key, _, _ in BASELINES if getattr(ev, key) is not None]
    free = [f for f in free if isinstance(f, (int, float))]
    ps = ev.prompt_set or {}
    sup = pr.supervised_tokens
    return CurvePoint(run_id=run_id, train_tokens=int(tokens // max(int(epochs), 1)), tau=float(tau),
                      best_free=max(free) if free else None, prompts=ps.get("source"),
                      k=ev.trained.num_speculative_tokens if ev.trained else None,
                      data="regenerated" if stages.get("regenerate") else "source",
                      supervised_tokens=sup if isinstance(sup, int) else None, implementation=series_key(ev))
