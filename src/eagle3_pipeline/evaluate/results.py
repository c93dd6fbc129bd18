"""The evaluate stage's per-run records and the pure arithmetic that makes them from the child's
counters (worker.SpecCounts, worker.RunOutput, worker.TimedPass): τ, per-position acceptance, the
per-category sums, speed-up, lossless mismatches. Nothing here starts a process.
"""

from __future__ import annotations

import statistics

from eagle3_pipeline.evaluate.worker import SpecCounts
from eagle3_pipeline.records.evaluation import (  # the models: records/evaluation.py (the report reads them)
    CategoryResult,
    EvalResult,
    LosslessMismatch,
    SampledResult,
    SpeedResult,
)


class EvaluateError(RuntimeError):
    """The evaluate child failed (bad checkpoint for vLLM, engine error, deadline) or measured nothing."""


def lossless_mismatches(plain: list[list[int]], spec: list[list[int]]) -> list[LosslessMismatch]:
    out = []
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        if a == b:
            continue
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        out.append(LosslessMismatch(prompt=i, position=k, expected=a[k] if k < len(a) else None,
                                    found=b[k] if k < len(b) else None))
    return out


def category_result(c, k: int) -> CategoryResult:
    """τ and per-position rates of one worker.SpecCounts (k drafted tokens per step)."""
    per_pos = (list(c.accepted_per_position) + [0] * k)[:k]
    tau = 1.0 + c.accepted_tokens / c.drafts if c.drafts > 0 else None
    steps = getattr(c, "steps", None)
    return CategoryResult(prompts=c.prompts, generated_tokens=c.generated_tokens, drafts=c.drafts,
                          draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens, accepted_per_position=per_pos,
                          acceptance_length=tau, per_position_acceptance=[a / c.drafts for a in per_pos] if c.drafts > 0 else [],
                          steps=steps, tokens_per_step=1.0 + c.accepted_tokens / steps if steps else None,
                          output_tokens_per_step=(c.generated_tokens - c.prompts) / steps if steps else None)


def check_category_sums(label: str, per_category: dict, total) -> None:
    """The categories' counters must add up to the pass's (each category's are a difference of the
    engine-global counters around its own generate call: a gap or an overlap shows here)."""
    fields = ("prompts", "generated_tokens", "drafts", "draft_tokens", "accepted_tokens")
    if getattr(total, "steps", None) is not None and all(getattr(c, "steps", None) is not None
                                                         for c in per_category.values()):
        fields += ("steps",)
    for f in fields:
        got = sum(getattr(c, f) for c in per_category.values())
        if got != getattr(total, f):
            raise EvaluateError(f"evaluate: the {label} run's per-category {f} add up to {got}, the pass counted "
                                f"{getattr(total, f)} ({ {k: getattr(c, f) for k, c in per_category.items()} })")
    k = max([len(total.accepted_per_position)] + [len(c.accepted_per_position) for c in per_category.values()])
    summed = [sum((list(c.accepted_per_position) + [0] * k)[j] for c in per_category.values()) for j in range(k)]
    if summed != (list(total.accepted_per_position) + [0] * k)[:k]:
        raise EvaluateError(f"evaluate: the {label} run's per-category accepted tokens per position add up to "
                            f"{summed}, the pass counted {total.accepted_per_position}")


def speed_result(timed) -> SpeedResult | None:
    """Median and spread of the timed rounds (worker.TimedPass list); None without any."""
    if not timed:
        return None
    tps = [t.generated_tokens / max(t.generate_s, 1e-9) for t in timed]
    return SpeedResult(rounds=len(timed), generate_s=[t.generate_s for t in timed],
                       generated_tokens=[t.generated_tokens for t in timed], tokens_per_s=tps,
                       tokens_per_s_median=statistics.median(tps), tokens_per_s_min=min(tps), tokens_per_s_max=max(tps))


def speedup_of(draft: SpeedResult, plain: SpeedResult) -> tuple[float, dict]:
    """(median tokens/s with the draft ÷ the target alone's, the numbers behind it)."""
    ratio = draft.tokens_per_s_median / plain.tokens_per_s_median
    return ratio, {
        "tokens_per_s_draft": draft.tokens_per_s_median, "tokens_per_s_plain": plain.tokens_per_s_median,
        "rounds": draft.rounds, "tokens_per_s_draft_min": draft.tokens_per_s_min,
        "tokens_per_s_draft_max": draft.tokens_per_s_max, "tokens_per_s_plain_min": plain.tokens_per_s_min,
        "tokens_per_s_plain_max": plain.tokens_per_s_max,
        "speedup_min": draft.tokens_per_s_min / plain.tokens_per_s_max,
        "speedup_max": draft.tokens_per_s_max / plain.tokens_per_s_min,
        "generate_s_draft": draft.generate_s, "generate_s_plain": plain.generate_s,
        "generated_tokens_draft": draft.generated_tokens, "generated_tokens_plain": plain.generated_tokens,
        "temperature": 0.0}


def eval_result(run, ref, n_prompts: int, plain_speed: SpeedResult | None = None, temperature: float | None = None,
            seed: int = 0) -> EvalResult:
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
        engine_start_s=run.engine_start_s, generate_s=run.generate_s, run_s=run.run_s,
        tokens_per_s=run.generated_tokens / max(run.generate_s, 1e-9), sample_texts=run.texts, steps=run.steps,
        output_tokens_per_step=(run.generated_tokens - n_prompts) / run.steps if run.steps else None,
        implementation=getattr(run, "implementation", None))
    if run.per_category:

        total = SpecCounts(prompts=n_prompts, generated_tokens=run.generated_tokens, drafts=run.drafts,
                           draft_tokens=run.draft_tokens, accepted_tokens=run.accepted_tokens,
                           accepted_per_position=run.accepted_per_position)
        check_category_sums(run.label, run.per_category, total)
        res.per_category = {c: category_result(v, k) for c, v in run.per_category.items()}
    if run.sampled is not None and run.sampled_total is not None:
        check_category_sums(f"{run.label} (sampled)", run.sampled, run.sampled_total)
        res.sampled = SampledResult(temperature=temperature or 0.0, seed=seed,
                                    total=category_result(run.sampled_total, k),
                                    per_category={c: category_result(v, k) for c, v in run.sampled.items()})
    res.speed = speed_result(run.timed)
    if res.speed is not None and plain_speed is not None:
        res.speedup, res.speedup_detail = speedup_of(res.speed, plain_speed)
    if ref is not None:
        res.lossless_checked, res.lossless_reference = n_prompts, ref.label
        res.lossless_mismatches = lossless_mismatches(ref.token_ids, run.token_ids)
        if ref.draft_dir is None:
            res.plain_tokens_per_s = ref.generated_tokens / max(ref.generate_s, 1e-9)
    return res


def tau_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
