"""The evaluate stage (a gate): how many draft tokens the target accepts when vLLM serves the draft.

How it works, what it reads and writes, its test hooks: docs/internals.md, `evaluate/stage.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.config import EvaluateConfig, PipelineConfig, TargetConfig, hub_token
from eagle3_pipeline.core.errors import GateFailed, InputError
from eagle3_pipeline.core.proc import EXCEPTION_LINE, ChildFailed, python_child, run_child
from eagle3_pipeline.core.stage_spec import CHILD, IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import dir_lock, write_json
from eagle3_pipeline.data.tokenized import PrepareResult, load_tokenizer
from eagle3_pipeline.engine import build as builds
from eagle3_pipeline.engine.build import engine_env
from eagle3_pipeline.engine.start import refusal_of
from eagle3_pipeline.evaluate.ngram import NgramBaseline, SuffixBaseline, describe_ngram, ngram_baseline
from eagle3_pipeline.evaluate.prompts import (
    DEFAULT_CATEGORY,
    QUARANTINE_NAME,
    PromptSet,
    PromptSetError,
    heldout_prompt_set,
    load_prompt_set,
    next_turns,
    prompt_token_limit,
    turn_of,
)
from eagle3_pipeline.evaluate.results import EvalResult, EvaluateError, SpeedResult, eval_result, speed_result, tau_text
from eagle3_pipeline.evaluate.worker import (
    ANSWERS,
    NGRAM,
    PLAIN,
    SUFFIX,
    EvalJob,
    EvalRunSpec,
    NgramLookup,
    RunOutput,
    SuffixTree,
    result_path,
    suffix_unavailable,
)
from eagle3_pipeline.records.contracts import model_dims
from eagle3_pipeline.records.evaluation import CategoryReport, EvaluateReport  # the models (the report reads them)
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.lineage import previous_draft
from eagle3_pipeline.records.results import TrainResult, VocabResult

WORKER = "eagle3_pipeline.evaluate.worker"
UNTRAINED = "untrained"  # label of the baseline run (evaluate_pair)
PREVIOUS = "previous"  # label of the previous version's draft (a refresh: lineage.previous_draft)
# An exception line anywhere in the child's output (proc.EXCEPTION_LINE). vLLM re-raises an engine process's
# failure as a generic "Engine core initialization failed. See root cause above", so the first such line is
# the one that names the problem.
_EXC_LINE = EXCEPTION_LINE


# vLLM's CPU build samples wrong tokens in speculative decoding, so its sampled τ is recorded but flagged
# (the measurement: docs/vllm-cpu.md, "Smaller items").
CPU_SAMPLING_WARNING = ("vLLM's CPU build ({version}) emits wrong tokens in speculative decoding at temperature "
                        "> 0 (measured: a draft with τ 2.87 greedy got τ 1.10 at temperature 0.01 and word salad "
                        "at 0.7, while the target alone samples normally), so this sampled τ does not measure the "
                        "draft; measure it on a GPU build")


def sampling_warning(sampled: bool) -> str | None:
    """Why the sampled pass's τ is not to be trusted on this vLLM build (None: no known reason)."""

    if not sampled or not builds.vllm_is_cpu_build():
        return None
    return CPU_SAMPLING_WARNING.format(version=f"vllm-cpu {version('vllm-cpu')}")


class InvalidDraftError(InputError):
    """A draft directory is not a usable EAGLE-3 checkpoint for this target (found before any engine)."""


class EvaluateGateFailed(GateFailed):
    """The trained draft's acceptance length is below `evaluate.min_acceptance_length` (or, with
    `evaluate.lossless_gate`, speculation changed the greedy output)."""


class DraftComparison(BaseModel):
    """`compare_drafts`: several EAGLE-3 checkpoints on the same prompts, one engine each + the target alone."""
    drafts: dict[str, EvalResult]
    per_category: dict[str, dict[str, CategoryReport]]  # label -> category -> numbers
    speedup: dict[str, float | None]  # label -> median tokens/s with the draft ÷ the target alone's
    plain_tokens_per_s: float | None  # median of the target alone's timed rounds
    sampling_temperature: float | None
    prompt_set: dict | None
    wall_s: float
    engine_start_s: float
    out_dir: str
    sampling_warning: str | None = None
    baseline_ngram: NgramBaseline | None = None
    baseline_suffix: SuffixBaseline | None = None
    baseline_suffix_unavailable: str | None = None
    acceptance_length_per_turn: dict[str, dict[str, float | None]] = {}  # label -> "turn n" -> τ


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


def _prompt_set(prompts, n: int):
    """The first `n` prompts as a PromptSet (plain lists of token ids: one category "default")."""
    if not isinstance(prompts, PromptSet):
        ids = [list(map(int, p)) for p in prompts]
        prompts = PromptSet(source="token ids", prompts=ids, categories=[DEFAULT_CATEGORY] * len(ids),
                            ids=[str(i) for i in range(len(ids))], rows_in=len(ids))
    if len(prompts.categories) != len(prompts.prompts):
        raise ValueError(f"evaluate: {len(prompts.categories)} categories for {len(prompts.prompts)} prompts")
    cut = prompts.model_copy(update={"prompts": [list(map(int, p)) for p in prompts.prompts[:n]],
                                     "categories": prompts.categories[:n], "ids": prompts.ids[:n],
                                     "followups": [f for f in prompts.followups if f.parent < n]})
    _check_prompts(cut.prompts)
    return cut


# ---------------------------------------------------------------- the child

@dataclass(frozen=True)
class EnginePlan:
    """The engine runs of one evaluate child: the drafts (label -> checkpoint dir), the labels that also
    get the sampled pass and the timed rounds, and whether vLLM's suffix decoding and n-gram baselines run
    (after the drafts; n-gram last)."""
    drafts: dict[str, Path]
    sampled: frozenset[str] = frozenset()
    timed: frozenset[str] = frozenset()
    ngram: bool = False
    suffix: bool = False


@dataclass
class Baselines:
    """The training-free baselines of one evaluation, and why the suffix one is missing where it was asked for."""
    ngram: NgramBaseline | None = None
    suffix: SuffixBaseline | None = None
    suffix_unavailable: str | None = None


def _ask_later_turns(cfg: EvaluateConfig, target: TargetConfig, pset, out_dir: Path, log: Callable[[str], None]):
    """The prompt set with every later turn of its rows added (evaluate.turns=all): round by round the target
    answers the turns before (greedy, alone, evaluate.turn_answer_max_tokens; one child each), and each next
    turn is asked after that answer (prompts.next_turns)."""
    tok = load_tokenizer(target)
    limit = prompt_token_limit(cfg.max_model_len, target.model, cfg.max_tokens, cfg.num_speculative_tokens)
    rnd = 0
    while pset.followups:
        rnd += 1
        parents = sorted({f.parent for f in pset.followups})
        sub = PromptSet(source=pset.source, prompts=[pset.prompts[i] for i in parents],
                        categories=[ANSWERS] * len(parents), ids=[pset.ids[i] for i in parents])
        log(f"evaluate: the target answers {len(parents)} turns before their next one (round {rnd})")
        answering = cfg.model_copy(update={"max_tokens": cfg.turn_answer_max_tokens})
        out = _run_child(answering, target, [EvalRunSpec(label=ANSWERS, draft_dir=None)], sub,
                         Path(out_dir) / f"answers-{rnd}", log)[ANSWERS]
        pset = next_turns(pset, dict(zip(parents, out.token_ids, strict=True)), tok,
                          max_tokens=cfg.turn_answer_max_tokens, max_prompt_tokens=limit, log=log)
    if pset.answers:
        log(f"evaluate: {len(pset.prompts)} prompts with the later turns; {pset.answers_cut} of {pset.answers} answers "
            f"before them ended at evaluate.turn_answer_max_tokens={cfg.turn_answer_max_tokens}")
    return pset


def _run_engines(cfg: EvaluateConfig, target: TargetConfig, plan: EnginePlan, prompts, out_dir: Path,
                 log: Callable[[str], None]) -> dict:
    """Run one child that evaluates `plan.drafts` (label -> dir) on `prompts` (a PromptSet), with
    `plan.ngram` vLLM's n-gram speculation (label NGRAM), and, with check_lossless or speedup, the target
    alone; return {label: RunOutput}. Labels in `plan.sampled` also get the pass at cfg.temperature, those
    in `plan.timed` (and the target alone, and n-gram) the timed rounds."""
    return _run_child(cfg, target, _run_specs(cfg, plan), prompts, out_dir, log)


def _run_child(cfg: EvaluateConfig, target: TargetConfig, runs: list, prompts, out_dir: Path,
               log: Callable[[str], None]) -> dict:
    """One evaluate child over `prompts` (a PromptSet) with the engine `runs` in order, cfg.max_tokens each;
    returns {label: RunOutput}."""
    max_tokens = cfg.max_tokens

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in runs:  # a gate never reads an earlier attempt's numbers
        result_path(out_dir, r.label).unlink(missing_ok=True)
    ids = prompts.prompts
    max_len = cfg.max_model_len or max(len(p) for p in ids) + max_tokens + cfg.num_speculative_tokens + 8
    job = EvalJob(target=target, engine=cfg.engine(), max_model_len=max_len, max_tokens=max_tokens,
                  sample_texts=cfg.sample_texts, prompts=ids, categories=prompts.categories,
                  temperature=cfg.temperature, seed=cfg.sampling_seed,
                  timing_rounds=cfg.speedup_rounds if cfg.speedup else 0, runs=runs, out_dir=str(out_dir.resolve()))
    job_path = write_json(out_dir / "job.json", job.model_dump(mode="json"))
    watch = _ChildWatch(log)
    env = engine_env(cfg)
    counts = prompts.category_counts()
    log(f"evaluate: {len(ids)} prompts in {len(counts)} categories, runs {[r.label for r in runs]}, "
        f"engine {'in process' if env else 'in its own processes'}, log {out_dir / 'evaluate.log'}")
    try:
        run_child(python_child(WORKER, str(job_path)), name="evaluate", timeout_s=cfg.timeout_s,
                  log_path=out_dir / "evaluate.log", on_line=watch.on_line, on_event=watch.on_event, env=env)
    except ChildFailed as e:
        refused = refusal_of(e, out_dir / "evaluate.log", "evaluate", cfg, "evaluate.max_model_len")
        if refused is not None:  # the same settings would be refused again: no retry, the key to change
            raise refused
        raise watch.failure(e) from e
    outs = {}
    for r in runs:
        p = result_path(out_dir, r.label)
        if not p.is_file():
            raise EvaluateError(f"evaluate: the child exited 0 but wrote no result for {r.label} ({p})")
        outs[r.label] = RunOutput.model_validate_json(p.read_text())
    return outs


def _run_specs(cfg: EvaluateConfig, plan: EnginePlan) -> list:
    """The child's engine runs in order: each draft, the target alone (the lossless reference or the speedup's
    baseline), vLLM's suffix decoding, then its n-gram speculation last (no engine can start in the child after it)."""
    drafts = plan.drafts
    for reserved, what in ((PLAIN, "the run without speculation"), (NGRAM, "the n-gram baseline"),
                           (SUFFIX, "the suffix decoding baseline"), ("answers", "the answers to earlier turns")):
        if reserved in drafts:
            raise ValueError(f"evaluate: {reserved!r} is reserved for {what}")
    runs = [EvalRunSpec(label=k, draft_dir=str(Path(v).resolve()), num_speculative_tokens=cfg.num_speculative_tokens,
                        sampled=k in plan.sampled and cfg.temperature is not None,
                        timed=k in plan.timed and cfg.speedup)
            for k, v in drafts.items()]
    if _reference(cfg, drafts) == PLAIN or cfg.speedup:
        runs.append(EvalRunSpec(label=PLAIN, draft_dir=None, timed=cfg.speedup))
    if plan.suffix:
        runs.append(EvalRunSpec(label=SUFFIX, draft_dir=None, num_speculative_tokens=cfg.num_speculative_tokens,
                                suffix=SuffixTree(max_tree_depth=cfg.suffix_max_tree_depth,
                                                  max_spec_factor=cfg.suffix_max_spec_factor,
                                                  min_token_prob=cfg.suffix_min_token_prob),
                                timed=cfg.speedup))
    if plan.ngram:
        runs.append(EvalRunSpec(label=NGRAM, draft_dir=None, num_speculative_tokens=cfg.num_speculative_tokens,
                                ngram=NgramLookup(prompt_lookup_min=cfg.ngram_prompt_lookup_min,
                                                  prompt_lookup_max=cfg.ngram_prompt_lookup_max),
                                timed=cfg.speedup))
    return runs


class _ChildWatch:
    """The evaluate child's output as it comes: its lines logged (the first exception lines kept as causes),
    its events turned into progress lines, its error events kept for the failure's message."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.errors, self.causes = log, [], []

    def on_line(self, line: str) -> None:
        self.log(line)
        m = _EXC_LINE.search(line)
        if m and len(self.causes) < 5:
            self.causes.append(m.group(0))

    def on_event(self, ev: dict) -> None:
        kind = ev.get("kind")
        if kind == "engine_ready":
            self.log(f"evaluate: engine for {ev['label']} ready in {ev['seconds']:.1f}s")
        elif kind == "run_done":
            speed = f", timed rounds {ev['timed_tokens_per_s']} tok/s" if ev.get("timed_tokens_per_s") else ""
            steps = f" in {ev['steps']} decode steps" if ev.get("steps") is not None else ""
            rss = f", worker RSS {ev['rss_gib']:.2f} GiB after shutdown" if ev.get("rss_gib") is not None else ""
            self.log(f"evaluate: {ev['label']}: {ev['generated_tokens']} tokens in {ev['generate_s']:.2f}s, "
                     f"{ev['drafts']} drafts, {ev['accepted']} draft tokens accepted{steps}{speed}{rss}")
        elif kind == "error":
            self.errors.append(ev)

    def failure(self, e: ChildFailed) -> EvaluateError:
        """The child's failure, naming the run that failed and the first error in its log."""
        cause = f"first error in the log: {self.causes[0]}; " if self.causes else ""
        if not self.errors:
            return EvaluateError(f"evaluate: {cause}{e}")
        ev = self.errors[-1]
        where = (f"draft {ev['draft_dir']}" if ev.get("draft_dir") else
                 "target with n-gram speculation" if ev.get("ngram") else
                 "target with suffix decoding" if ev.get("suffix") else "target without speculation")
        if self.causes and self.causes[0] == ev["error"]:
            cause = ""
        return EvaluateError(f"evaluate: vLLM failed on the {ev['label']} run ({where}): {cause}{ev['error']}\n{e}")


def _reference(cfg: EvaluateConfig, drafts: dict) -> str | None:
    """Label of the lossless reference run (module doc), or None without the check."""
    if not cfg.check_lossless:
        return None
    return UNTRAINED if cfg.lossless_reference == UNTRAINED and UNTRAINED in drafts else PLAIN


def _describe(r: EvalResult) -> str:
    pos = ", ".join(f"{p:.3f}" for p in r.per_position_acceptance)
    s = (f"{r.label}: τ={r.acceptance_length:.3f}, per position [{pos}], {r.drafts} drafts, "
         f"{r.generated_tokens} tokens")
    if r.sampled is not None and r.sampled.total.acceptance_length is not None:
        s += f", τ={r.sampled.total.acceptance_length:.3f} at temperature {r.sampled.temperature}"
    if r.speed is not None:
        s += f", {r.speed.tokens_per_s_median:.1f} tok/s (median of {r.speed.rounds})"
    if r.speedup is not None:
        s += f", speed-up {r.speedup:.3f}x"
    if r.lossless_mismatches is not None:
        s += f", lossless mismatches {len(r.lossless_mismatches)}/{r.lossless_checked} vs {r.lossless_reference}"
    return s + (f" [{r.implementation.name}]" if r.implementation is not None else "")


def _evaluate(cfg: EvaluateConfig, target: TargetConfig, plan: EnginePlan, prompts, out_dir: Path,
              log: Callable[[str], None]
              ) -> tuple[dict[str, EvalResult], float, SpeedResult | None, object, Baselines]:
    """({label: EvalResult}, summed engine start-up seconds of every run incl. the reference and the baselines,
    the target alone's timed rounds or None, the PromptSet used, the training-free baselines (with `plan.ngram`
    / `plan.suffix` and cfg.baseline_ngram / cfg.baseline_suffix))."""
    drafts = plan.drafts
    for d in drafts.values():
        validate_draft_dir(d, target)
    pset = _ask_later_turns(cfg, target, _prompt_set(prompts, cfg.num_prompts), out_dir, log)
    bases = Baselines(suffix_unavailable=suffix_unavailable() if plan.suffix and cfg.baseline_suffix else None)
    if bases.suffix_unavailable:
        log(f"evaluate: no suffix decoding baseline: {bases.suffix_unavailable}")
    plan = replace(plan, ngram=plan.ngram and cfg.baseline_ngram,
                   suffix=plan.suffix and cfg.baseline_suffix and not bases.suffix_unavailable)
    outs = _run_engines(cfg, target, plan, pset, out_dir, log)
    ref = _reference(cfg, drafts)
    plain_speed = speed_result(outs[PLAIN].timed) if PLAIN in outs else None
    results = {k: eval_result(outs[k], outs[ref] if ref and ref != k else None, len(pset.prompts), plain_speed,
                              cfg.temperature, cfg.sampling_seed) for k in drafts}
    for label, field in ((NGRAM, "ngram"), (SUFFIX, "suffix")):
        if label in outs:
            setattr(bases, field, ngram_baseline(outs[label], outs[ref] if ref else None, plain_speed))
    if plain_speed is not None:
        log(f"evaluate: target alone: {plain_speed.tokens_per_s_median:.1f} tok/s (median of {plain_speed.rounds}, "
            f"{plain_speed.tokens_per_s_min:.1f}-{plain_speed.tokens_per_s_max:.1f})")
    for r in results.values():
        log(f"evaluate: {_describe(r)}")
        if len(r.per_category) > 1 or (r.per_category and next(iter(r.per_category)) != "default"):
            cats = ", ".join(f"{c} {tau_text(v.acceptance_length)}" + (
                f"/{tau_text(r.sampled.per_category[c].acceptance_length)}" if r.sampled else "")
                for c, v in r.per_category.items())
            log(f"evaluate: {r.label} τ per category (temperature 0" + (
                f"/{r.sampled.temperature}" if r.sampled else "") + f"): {cats}")
        for m in (r.lossless_mismatches or [])[:5]:
            log(f"evaluate: WARNING {r.label}: prompt {m.prompt} differs from plain greedy decoding at generated "
                f"position {m.position}: expected token {m.expected}, found {m.found}")
    for b in (bases.suffix, bases.ngram):
        if b is not None:
            log(f"evaluate: {describe_ngram(b)}")
    return results, round(sum(o.engine_start_s for o in outs.values()), 3), plain_speed, pset, bases


def per_turn(r: EvalResult) -> dict[str, float | None]:
    """τ of draft `r` over each turn's prompts ("turn 1": first turns, "turn 2": MT-Bench's second, ...) from
    its per-category counters; empty when every prompt is a first turn."""
    sums: dict[int, list[int]] = {}
    for c, v in r.per_category.items():
        s = sums.setdefault(turn_of(c), [0, 0])
        s[0], s[1] = s[0] + v.accepted_tokens, s[1] + v.drafts
    if len(sums) < 2:
        return {}
    return {f"turn {t}": (1 + a / d if d else None) for t, (a, d) in sorted(sums.items())}


def engine_costs(results: dict[str, EvalResult], bases: Baselines) -> dict[str, float | None]:
    """{label: seconds of that engine's whole run in the child}: what each number of the report cost."""
    out = {label: r.run_s for label, r in results.items()}
    for label, b in (("suffix", bases.suffix), ("ngram", bases.ngram)):
        if b is not None:
            out[label] = b.run_s
    return out


def category_reports(r: EvalResult, untrained: EvalResult | None = None,
                     bases: Baselines | None = None) -> dict[str, CategoryReport]:
    """report.json's per_category entries of draft `r` (and the untrained baseline's τ and the training-free
    baselines' tokens per step beside them)."""
    out = {}
    ngram, suffix = (bases.ngram, bases.suffix) if bases else (None, None)
    for c, v in r.per_category.items():
        s = r.sampled.per_category.get(c) if r.sampled else None
        u = untrained.per_category.get(c) if untrained else None
        g = ngram.per_category.get(c) if ngram else None
        x = suffix.per_category.get(c) if suffix else None
        out[c] = CategoryReport(
            prompts=v.prompts, acceptance_length=v.acceptance_length, per_position_acceptance=v.per_position_acceptance,
            acceptance_length_untrained=u.acceptance_length if u else None,
            acceptance_length_sampled=s.acceptance_length if s else None,
            per_position_acceptance_sampled=s.per_position_acceptance if s else None,
            drafts=v.drafts, accepted_tokens=v.accepted_tokens, generated_tokens=v.generated_tokens,
            tokens_per_step_ngram=g.tokens_per_step if g else None,
            tokens_per_step_suffix=x.tokens_per_step if x else None)
    return out


# ---------------------------------------------------------------- public API

def evaluate_draft(cfg: EvaluateConfig, target: TargetConfig, draft_dir: Path, prompts,
                   out_dir: Path, *, log: Callable[[str], None] = print, label: str = "trained") -> EvalResult:
    """Serve `draft_dir` as the EAGLE-3 draft of `target` in vLLM, decode the first `cfg.num_prompts`
    prompts (token ids or a PromptSet) and measure acceptance (and, with cfg.temperature / cfg.speedup,
    the sampled pass and the speed-up). One child process; see the module doc."""
    with dir_lock(Path(out_dir), f"evaluate dir {out_dir}", log):
        plan = EnginePlan({label: Path(draft_dir)}, sampled=frozenset({label}), timed=frozenset({label}))
        return _evaluate(cfg, target, plan, prompts, out_dir, log)[0][label]


def evaluate_pair(cfg: EvaluateConfig, target: TargetConfig, trained_dir: Path, untrained_dir: Path | None,
                  prompts, out_dir: Path, log: Callable[[str], None] = print,
                  previous_dir: Path | None = None) -> EvaluateReport:
    """Evaluate the trained draft and (unless `untrained_dir` is None) the untrained baseline in one
    child, on the same prompts (token ids or a PromptSet); `passed` compares the trained τ with
    `cfg.min_acceptance_length`. Does not raise on a low τ: call `check_acceptance_gate`. Writes
    `out_dir/evaluate.json`."""
    with dir_lock(Path(out_dir), f"evaluate dir {out_dir}", log):
        return _evaluate_pair(cfg, target, trained_dir, untrained_dir, prompts, out_dir, log, previous_dir)


def _evaluate_pair(cfg: EvaluateConfig, target: TargetConfig, trained_dir: Path, untrained_dir: Path | None,
                   prompts, out_dir: Path, log: Callable[[str], None],
                   previous_dir: Path | None = None) -> EvaluateReport:
    """`previous_dir`: the previous version's draft (a refresh), run in the same child on the same prompts."""
    t0 = time.time()
    drafts = {"trained": Path(trained_dir)}
    if untrained_dir is not None:
        drafts[UNTRAINED] = Path(untrained_dir)
    if previous_dir is not None:
        drafts[PREVIOUS] = Path(previous_dir)
    plan = EnginePlan(drafts, sampled=frozenset({"trained"}), timed=frozenset({"trained"}), ngram=True, suffix=True)
    res, engine_start_s, _, pset, bases = _evaluate(cfg, target, plan, prompts, out_dir, log)
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
        previous=res.get(PREVIOUS), per_category=category_reports(tr, un, bases), speedup=tr.speedup,
        speedup_detail=tr.speedup_detail, sampling_temperature=tr.sampled.temperature if tr.sampled else None,
        acceptance_length_sampled=tr.sampled.total.acceptance_length if tr.sampled else None,
        acceptance_length_per_turn=per_turn(tr),
        per_position_acceptance_sampled=tr.sampled.total.per_position_acceptance if tr.sampled else None,
        prompt_set=pset.summary(), sampling_warning=sampling_warning(tr.sampled is not None),
        baseline_ngram=bases.ngram, baseline_suffix=bases.suffix, baseline_suffix_unavailable=bases.suffix_unavailable,
        engine_run_s=engine_costs(res, bases))
    log("evaluate: cost per engine run (start, passes, shutdown): "
        + ", ".join(f"{k} {'-' if v is None else f'{v:.1f}'} s" for k, v in rep.engine_run_s.items()))
    if rep.sampling_warning:
        log(f"evaluate: WARNING {rep.sampling_warning}")
    rep.passed = gate_failure(rep, cfg) is None
    if un is not None and tr.acceptance_length <= un.acceptance_length:
        log(f"evaluate: WARNING the trained draft (τ={tr.acceptance_length:.3f}) is no better than the untrained "
            f"one (τ={un.acceptance_length:.3f})")
    for name, base in (("n-gram speculation", bases.ngram), ("suffix decoding", bases.suffix)):
        if base is not None and base.tokens_per_step is not None and tr.acceptance_length <= base.tokens_per_step:
            log(f"evaluate: WARNING the trained draft (τ={tr.acceptance_length:.3f}) is no better than vLLM's {name} "
                f"without any draft ({base.tokens_per_step:.3f} tokens per target step)")
    write_json(Path(out_dir) / "evaluate.json", rep.model_dump(mode="json"))
    return rep


def compare_drafts(cfg: EvaluateConfig, target: TargetConfig, drafts: dict[str, Path], prompts, out_dir: Path,
                   log: Callable[[str], None] = print) -> DraftComparison:
    """Evaluate every checkpoint of `drafts` (label -> speculators EAGLE-3 dir; all validated against
    `target` before any engine starts) on the same prompts in one child: τ per category at temperature 0
    and at cfg.temperature, and each one's speed-up over the target alone (cfg.speedup). No gate.
    Writes `out_dir/evaluate.json` (the DraftComparison)."""
    if not drafts:
        raise ValueError("evaluate: no drafts to compare")
    t0 = time.time()
    with dir_lock(Path(out_dir), f"evaluate dir {out_dir}", log):
        labels = frozenset(drafts)
        plan = EnginePlan({k: Path(v) for k, v in drafts.items()}, sampled=labels, timed=labels, ngram=True,
                          suffix=True)
        res, engine_start_s, plain_speed, pset, bases = _evaluate(cfg, target, plan, prompts, out_dir, log)
        rep = DraftComparison(
            drafts=res, per_category={k: category_reports(r, bases=bases) for k, r in res.items()},
            speedup={k: r.speedup for k, r in res.items()},
            plain_tokens_per_s=plain_speed.tokens_per_s_median if plain_speed else None,
            sampling_temperature=cfg.temperature, prompt_set=pset.summary(), wall_s=round(time.time() - t0, 3),
            engine_start_s=engine_start_s, out_dir=str(Path(out_dir).resolve()),
            sampling_warning=sampling_warning(any(r.sampled is not None for r in res.values())),
            baseline_ngram=bases.ngram, baseline_suffix=bases.suffix, baseline_suffix_unavailable=bases.suffix_unavailable,
            acceptance_length_per_turn={k: t for k, r in res.items() if (t := per_turn(r))})
        if rep.sampling_warning:
            log(f"evaluate: WARNING {rep.sampling_warning}")
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


def evaluate_prompts(cfg: PipelineConfig, prep: PrepareResult | None, out_dir: Path, log: Log = print) -> PromptSet:
    """The evaluate stage's prompts: `evaluate.prompts` rendered with the target's chat template (skipped rows
    quarantined in `out_dir`), else prepare's held-out prompts (`prep`)."""
    ev = cfg.evaluate
    if ev.prompts is None:
        if prep is None:
            raise PromptSetError("evaluate: no evaluate.prompts and no prepared data to take held-out prompts from")
        pset = heldout_prompt_set(prep.heldout, ev.num_prompts)
        if not pset.prompts:
            raise RuntimeError(f"evaluate: no held-out prompts in {prep.heldout} (prepare.heldout_rows is 0?)")
        return pset
    limit = prompt_token_limit(ev.max_model_len, cfg.target.model, ev.max_tokens, ev.num_speculative_tokens)
    return load_prompt_set(ev.prompts, load_tokenizer(cfg.target), num_prompts=ev.num_prompts, max_prompt_tokens=limit,
                           split=ev.prompts_split, token=hub_token(cfg.target),
                           quarantine_path=Path(out_dir) / QUARANTINE_NAME, log=log, all_turns=ev.turns == "all")


class EvaluateInputs(BaseModel):
    prep: PrepareResult | None  # its held-out prompts, where evaluate.prompts names none
    version: ExtractVersion  # the data the draft was trained on: the previous version's draft is found beside it
    voc: VocabResult  # the draft vocabulary (the untrained baseline's too)
    tr: TrainResult  # the trained draft, and the untrained one in its directory
    run_dir: str  # the run's directory: evaluate writes in its `evaluate/`


def run(cfg: PipelineConfig, inputs: EvaluateInputs, log: Log) -> EvaluateReport:
    """The stage's entry (StageSpec.run): the trained draft against the untrained one (evaluate.baseline) and the
    previous version's (evaluate.compare_previous) on the same prompts; the acceptance gate on the result."""
    out = Path(inputs.run_dir) / "evaluate"
    prompts = evaluate_prompts(cfg, inputs.prep, out, log=log)
    untrained = inputs.tr.untrained_dir() if cfg.evaluate.baseline else None
    prev = previous_draft(inputs.version) if cfg.evaluate.compare_previous or cfg.train.init == "previous" else None
    if prev is not None:
        log(f"evaluate: also the previous version's draft {prev.checkpoint} on the same held-out prompts")
    rep = evaluate_pair(cfg.evaluate, cfg.target, Path(inputs.tr.checkpoint_best), untrained, prompts, out, log=log,
                        previous_dir=Path(prev.checkpoint) if prev else None)
    check_acceptance_gate(rep, cfg.evaluate)
    return rep


RETRY = Retry(1, 30, (*IO, *CHILD, RuntimeError),
              "starts vLLM engines (a failed engine start: port, memory not yet freed); never when τ is below the "
              "floor (EvaluateGateFailed)")
STAGE = StageSpec(name="evaluate", run=run, result=EvaluateReport, failure=EvaluateGateFailed,
                  worker="eagle3_pipeline.evaluate.worker", accelerators=True, gate=True, own_job=True, retry=RETRY)
