"""The evaluate report says what each of its numbers cost: every engine's whole run (start, passes,
shutdown), trained, untrained and the n-gram baseline (evaluate/stage.py engine_costs)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluate.ngram import ngram_baseline
from eagle3_pipeline.evaluate.results import eval_result
from eagle3_pipeline.evaluate.stage import Baselines, engine_costs
from eagle3_pipeline.evaluate.worker import NgramLookup, RunOutput, SpecCounts, SuffixTree

pytest.importorskip("vllm.v1.metrics.reader")
K = 3


def _run(label: str, run_s: float | None, draft_dir: str | None = "d") -> RunOutput:
    cats = {"chat": SpecCounts(prompts=2, generated_tokens=18, drafts=10, draft_tokens=30, accepted_tokens=6,
                               accepted_per_position=[3, 2, 1], steps=10, generate_s=0.4)}
    return RunOutput(label=label, draft_dir=draft_dir, num_speculative_tokens=K, engine_start_s=1.5, generate_s=0.4,
                     prompt_tokens=40, generated_tokens=18, drafts=10, draft_tokens=30, accepted_tokens=6,
                     accepted_per_position=[3, 2, 1], steps=10, token_ids=[[1, 2]] * 2, texts=[], per_category=cats,
                     run_s=run_s, ngram=NgramLookup(prompt_lookup_min=2, prompt_lookup_max=4) if draft_dir is None
                     else None)


def test_every_engine_run_has_its_cost():
    results = {"trained": eval_result(_run("trained", 12.5), None, 2),
               "untrained": eval_result(_run("untrained", 9.25), None, 2)}
    assert results["trained"].run_s == 12.5 and results["untrained"].run_s == 9.25
    base = ngram_baseline(_run("ngram", 7.0, draft_dir=None), None, None)
    suffix_run = _run("suffix", 5.5, draft_dir=None).model_copy(update={
        "ngram": None, "suffix": SuffixTree(max_tree_depth=24, max_spec_factor=1.0, min_token_prob=0.1)})
    suffix = ngram_baseline(suffix_run, None, None)
    assert suffix.method == "suffix" and suffix.max_tree_depth == 24 and suffix.tokens_per_step == base.tokens_per_step
    assert engine_costs(results, Baselines(ngram=base, suffix=suffix)) == {"trained": 12.5, "untrained": 9.25,
                                                                          "suffix": 5.5, "ngram": 7.0}
    assert engine_costs(results, Baselines()) == {"trained": 12.5, "untrained": 9.25}
    # a run from an older child without run_s: the cost is unknown, not zero
    assert engine_costs({"trained": eval_result(_run("trained", None), None, 2)}, Baselines()) == {"trained": None}


def test_a_missing_suffix_backend_is_reported_not_hidden(monkeypatch):
    """Without arctic-inference (or with its compiled part unloadable) the evaluation runs on and says why there
    is no suffix baseline; here it loads (make install builds it)."""
    import sys

    from eagle3_pipeline.evaluate.worker import suffix_unavailable

    assert suffix_unavailable() is None
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # import of it fails
    why = suffix_unavailable()
    assert why and "arctic-inference" in why and "ModuleNotFoundError" in why and "make install" in why
