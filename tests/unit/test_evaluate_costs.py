"""The evaluate report says what each of its numbers cost: every engine's whole run (start, passes,
shutdown), trained, untrained and the n-gram baseline (evaluate/stage.py engine_costs)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluate.ngram import ngram_baseline
from eagle3_pipeline.evaluate.results import eval_result
from eagle3_pipeline.evaluate.stage import engine_costs
from eagle3_pipeline.evaluate.worker import NgramLookup, RunOutput, SpecCounts

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
    assert engine_costs(results, base) == {"trained": 12.5, "untrained": 9.25, "ngram": 7.0}
    assert engine_costs(results, None) == {"trained": 12.5, "untrained": 9.25}
    # a run from an older child without run_s: the cost is unknown, not zero
    assert engine_costs({"trained": eval_result(_run("trained", None), None, 2)}, None) == {"trained": None}
