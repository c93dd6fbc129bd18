"""vLLM's training-free speculation, n-gram (prompt lookup) and suffix decoding, as the evaluate stage's baselines.

More: docs/internals.md, "evaluate/ngram.py".
"""

from __future__ import annotations

from eagle3_pipeline.evaluate.results import (
    EvaluateError,
    SpeedResult,
    check_category_sums,
    lossless_mismatches,
    speed_result,
    speedup_of,
    tau_text,
)
from eagle3_pipeline.evaluate.worker import SpecCounts
from eagle3_pipeline.records.evaluation import NgramBaseline, NgramCategory, SuffixBaseline  # the models

NGRAM_LABEL = "ngram"  # label of the n-gram baseline run (worker.NGRAM)
# Suffix decoding (`baseline_suffix`, vLLM's `method: suffix`: arctic-inference on Model Runner V1, vLLM's own GPU
# proposer on 0.34's V2; each baseline names its `implementation`) is measured and counted the same
# way, with the same k; its trees also hold the earlier prompts' responses of the same pass, as in serving.


def ngram_category(c, k: int, label: str = NGRAM_LABEL) -> NgramCategory:
    """The n-gram baseline's numbers from one worker.SpecCounts (module doc): decode steps from the
    inter-token-latency count, every one in the denominator, proposing or not. Without that count
    (`c.steps` None) the steps are `generated - prompts - accepted`, a lower bound (`steps_source`).
    Raises EvaluateError when the counts cannot come from one decoding: each request emits 1 token at
    prefill and 1 + accepted per decode step, of which a stop or max_tokens cuts at most k at its end."""
    if c.steps is not None:
        steps, source = c.steps, "inter_token_latency"
    else:
        steps, source = max(c.generated_tokens - c.prompts - c.accepted_tokens, 0), "generated_minus_accepted"
    past_end = c.prompts + steps + c.accepted_tokens - c.generated_tokens
    if not 0 <= past_end <= k * c.prompts or c.drafts > steps:
        raise EvaluateError(
            f"evaluate: the {label} run's counters do not describe one decoding: {c.generated_tokens} tokens generated "
            f"for {c.prompts} prompts in {steps} decode steps ({source}), {c.drafts} of them with a proposal, "
            f"{c.accepted_tokens} tokens accepted; expected prompts + steps + accepted - generated in [0, "
            f"{k * c.prompts}] (found {past_end}) and proposals <= steps")
    return NgramCategory(
        prompts=c.prompts, tokens_per_step=1.0 + c.accepted_tokens / steps if steps else None, steps=steps,
        proposed_steps=c.drafts, draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens,
        generated_tokens=c.generated_tokens,
        acceptance_length_proposed=1.0 + c.accepted_tokens / c.drafts if c.drafts else None,
        output_tokens_per_step=(c.generated_tokens - c.prompts) / steps if steps else None, tokens_past_end=past_end,
        steps_source=source)


def ngram_baseline(run, ref=None, plain_speed: SpeedResult | None = None) -> NgramBaseline | SuffixBaseline:
    """report.json's baseline_ngram (or baseline_suffix, for a suffix decoding run) from the baseline run's
    RunOutput (and the lossless reference's, and the target alone's timed rounds)."""
    k = run.num_speculative_tokens
    total = SpecCounts(prompts=len(run.token_ids), generated_tokens=run.generated_tokens, drafts=run.drafts,
                       draft_tokens=run.draft_tokens, accepted_tokens=run.accepted_tokens,
                       accepted_per_position=run.accepted_per_position, steps=run.steps)
    if run.per_category:
        check_category_sums(run.label, run.per_category, total)
    per_pos = (list(run.accepted_per_position) + [0] * k)[:k]
    common = dict(**ngram_category(total, k, run.label).model_dump(), num_speculative_tokens=k,
                  per_category={c: ngram_category(v, k, f"{run.label} ({c})") for c, v in run.per_category.items()},
                  per_position_acceptance=[a / run.drafts for a in per_pos] if run.drafts else [],
                  engine_start_s=run.engine_start_s, generate_s=run.generate_s, run_s=run.run_s,
                  implementation=getattr(run, "implementation", None))
    if getattr(run, "suffix", None) is not None:
        base = SuffixBaseline(**common, max_tree_depth=run.suffix.max_tree_depth,
                              max_spec_factor=run.suffix.max_spec_factor, min_token_prob=run.suffix.min_token_prob)
    else:
        base = NgramBaseline(**common, prompt_lookup_min=run.ngram.prompt_lookup_min if run.ngram else 0,
                             prompt_lookup_max=run.ngram.prompt_lookup_max if run.ngram else 0)
    speed = speed_result(run.timed)
    if speed is not None:
        base.tokens_per_s = speed.tokens_per_s_median
        if plain_speed is not None:
            base.speedup = speedup_of(speed, plain_speed)[0]
    if ref is not None:
        base.lossless_checked, base.lossless_reference = len(run.token_ids), ref.label
        base.lossless_mismatches = len(lossless_mismatches(ref.token_ids, run.token_ids))
    return base


def describe_ngram(b: NgramBaseline | SuffixBaseline) -> str:
    what = (f"suffix decoding baseline (k={b.num_speculative_tokens}, tree depth {b.max_tree_depth})"
            if isinstance(b, SuffixBaseline) else
            f"n-gram baseline (k={b.num_speculative_tokens}, n {b.prompt_lookup_min}-{b.prompt_lookup_max})")
    if b.implementation is not None:
        what += f" [{b.implementation.name}]"
    s = (f"{what}: "
         f"{tau_text(b.tokens_per_step)} tokens per target step over all {b.steps} decode steps, a proposal on "
         f"{b.proposed_steps} (vLLM's mean acceptance length over those: {tau_text(b.acceptance_length_proposed)}), "
         f"{b.tokens_past_end} confirmed tokens past an answer's end")
    if len(b.per_category) > 1 or (b.per_category and next(iter(b.per_category)) != "default"):
        s += "; per category " + ", ".join(f"{c} {tau_text(v.tokens_per_step)}" for c, v in b.per_category.items())
    if b.speedup is not None:
        s += f", speed-up {b.speedup:.3f}x"
    if b.lossless_mismatches:
        s += f", WARNING {b.lossless_mismatches}/{b.lossless_checked} prompts differ from {b.lossless_reference}"
    return s + f"; cost {b.run_s:.1f}s (engine start {b.engine_start_s:.1f}s)" if b.run_s is not None else s
