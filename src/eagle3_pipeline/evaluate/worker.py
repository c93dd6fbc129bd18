"""The evaluate child process: `python -m eagle3_pipeline.evaluate.worker JOB.json`.

How it works, what it reads and writes, its test hooks: docs/internals.md, `evaluate/worker.py`.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict, model_validator

from eagle3_pipeline.core import heap
from eagle3_pipeline.core.config import EngineConfig, TargetConfig
from eagle3_pipeline.core.faults import take_fault
from eagle3_pipeline.core.proc import emit_event
from eagle3_pipeline.core.progress import LineProgress
from eagle3_pipeline.core.store import write_json
from eagle3_pipeline.engine import surface
from eagle3_pipeline.engine.build import ENGINE_PRELOAD, build_llm, eagle3_config
from eagle3_pipeline.evaluate.implementation import Implementation
from eagle3_pipeline.evaluate.implementation import installed as installed_implementation

FORK_PRELOAD = ENGINE_PRELOAD  # what a fork server imports before forking this worker (core/forkserver.py)

PLAIN = "plain"  # label of the run without speculation (the lossless reference)
NGRAM = "ngram"  # label of the n-gram (prompt lookup) baseline run
ANSWERS = "answers"  # label of the target's own answers to earlier turns (evaluate.turns=all)
SUFFIX = "suffix"  # label of the suffix decoding baseline run (vLLM's `method: suffix`, arctic-inference)
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# a histogram; its count = one observation per request per decode step that emitted tokens (not the prefill's)
INTER_TOKEN = "vllm:inter_token_latency_seconds"


class NgramLookup(BaseModel):
    """vLLM's n-gram (prompt lookup) proposer: the longest suffix n-gram of the context, n in
    [prompt_lookup_min, prompt_lookup_max], found earlier in it proposes the (up to k) tokens that followed."""
    model_config = ConfigDict(extra="forbid")
    prompt_lookup_min: int
    prompt_lookup_max: int


def ngram_config(num_speculative_tokens: int, lookup: NgramLookup) -> dict:
    """vLLM's speculative config of n-gram speculation (no draft model; vllm/config/speculative.py)."""
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": lookup.prompt_lookup_max, "prompt_lookup_min": lookup.prompt_lookup_min}


class SuffixTree(BaseModel):
    """vLLM's suffix decoding: suffix trees of the prompt and of earlier responses (arctic-inference) propose up
    to k tokens that followed the context's longest matching suffix, where they were likely enough."""
    model_config = ConfigDict(extra="forbid")
    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float


def suffix_config(num_speculative_tokens: int, tree: SuffixTree) -> dict:
    """vLLM's speculative config of suffix decoding (no draft model; vllm/config/speculative.py)."""
    return {"method": "suffix", "num_speculative_tokens": num_speculative_tokens,
            "suffix_decoding_max_tree_depth": tree.max_tree_depth,
            "suffix_decoding_max_spec_factor": tree.max_spec_factor,
            "suffix_decoding_min_token_prob": tree.min_token_prob}


def suffix_unavailable() -> str | None:
    """Why vLLM's suffix decoding cannot run in this environment (its backend on Model Runner V1, arctic-inference,
    is a source build: `make install` builds it), or None when it can. A vLLM without V1 (0.34) decodes suffixes
    with its own GPU proposer: nothing to load (another implementation: docs/vllm-versions.md)."""
    try:
        if surface.engine_runner(surface.installed_tree(), "gpu") == surface.V2:
            return None
    except (ModuleNotFoundError, LookupError):
        pass
    try:

        importlib.import_module("arctic_inference.suffix_decoding")
    except Exception as e:  # noqa: BLE001 - not installed, or its compiled part does not load here
        return (f"arctic-inference (vLLM's suffix decoding backend) does not load here: {type(e).__name__}: {e}; "
                "it is built from source by `make install` (docs/evaluation.md)")
    return None


class EvalRunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    draft_dir: str | None  # None: plain greedy decoding of the target alone (or a training-free baseline)
    num_speculative_tokens: int = 0
    ngram: NgramLookup | None = None  # n-gram speculation instead of a draft model (draft_dir None)
    suffix: SuffixTree | None = None  # suffix decoding instead of a draft model (draft_dir None)
    sampled: bool = False  # also the pass at the job's temperature
    timed: bool = False  # also the timed rounds (speed-up)


class EvalJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: TargetConfig
    engine: EngineConfig
    max_model_len: int
    max_tokens: int
    sample_texts: int = 4
    prompts: list[list[int]]
    categories: list[str] | None = None  # one per prompt; None: all in one category "default"
    temperature: float | None = None  # the sampled pass's temperature (runs with `sampled`)
    seed: int = 0
    timing_rounds: int = 0  # timed passes of runs with `timed`
    runs: list[EvalRunSpec]
    out_dir: str

    @model_validator(mode="after")
    def _ngram_last(self) -> "EvalJob":
        for r in self.runs[:-1]:
            if r.ngram is not None:
                raise ValueError(f"evaluate job: the n-gram run {r.label!r} must be the last run (no vLLM engine "
                                 f"starts in this process after the n-gram proposer imported numba on the CPU "
                                 f"build; module doc), found runs {[x.label for x in self.runs]}")
        return self


class SpecCounts(BaseModel):
    """vLLM's speculative-decoding counters over some generate calls, and what those calls produced."""
    model_config = ConfigDict(extra="forbid")
    prompts: int = 0
    generated_tokens: int = 0
    generate_s: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = []
    steps: int | None = None  # target decode steps (one per request per step after its prefill); None: not read


class TimedPass(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generate_s: float
    generated_tokens: int


class RunOutput(BaseModel):
    """What one run measured; counters are deltas over this run's generate call."""
    model_config = ConfigDict(extra="forbid")
    label: str
    draft_dir: str | None
    num_speculative_tokens: int
    engine_start_s: float
    generate_s: float
    prompt_tokens: int
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    steps: int | None = None  # target decode steps of the greedy pass (SpecCounts.steps)
    ngram: NgramLookup | None = None
    suffix: SuffixTree | None = None
    implementation: Implementation | None = None  # what proposed: vLLM version, runner, backend (None: no proposer)
    token_ids: list[list[int]]  # generated ids per prompt, prompt order
    texts: list[str]  # generated text of the first `sample_texts` prompts
    per_category: dict[str, SpecCounts] = {}  # greedy pass, one generate call per category
    sampled: dict[str, SpecCounts] | None = None  # the pass at the job's temperature, per category
    sampled_total: SpecCounts | None = None
    timed: list[TimedPass] = []
    run_s: float | None = None  # wall seconds of the whole run in the child: engine start, every pass, shutdown


def result_path(out_dir: str | Path, label: str) -> Path:
    return Path(out_dir) / f"{label}.result.json"


def read_spec_counters(metrics) -> dict:
    """Sum vLLM's speculative-decoding counters over all label sets (engines) of a
    `LLM.get_metrics()` snapshot: drafts, draft_tokens, accepted, per_pos (list, one per position), and
    steps (the count of the inter-token-latency histogram: decode steps; None when vLLM has no such metric)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [], "steps": None}
    names = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}
    for m in metrics:
        if m.name in names and hasattr(m, "value"):
            out[names[m.name]] += int(m.value)
        elif m.name == INTER_TOKEN and hasattr(m, "count"):
            out["steps"] = (out["steps"] or 0) + int(m.count)
        elif m.name == ACCEPTED_PER_POS and hasattr(m, "values"):
            vals = [int(v) for v in m.values]
            per = out["per_pos"] + [0] * max(0, len(vals) - len(out["per_pos"]))
            out["per_pos"] = [a + (vals[i] if i < len(vals) else 0) for i, a in enumerate(per)]
    return out


def _delta(after: dict, before: dict, k: int) -> dict:
    pos_a = after["per_pos"] + [0] * max(0, k - len(after["per_pos"]))
    pos_b = before["per_pos"] + [0] * max(0, len(pos_a) - len(before["per_pos"]))
    return {"drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"],
            "per_pos": [a - b for a, b in zip(pos_a, pos_b, strict=False)][: max(k, 0)],
            "steps": None if after.get("steps") is None else after["steps"] - (before.get("steps") or 0)}


# ---------------------------------------------------------------- engine side (child only)

def _shutdown(llm) -> None:
    """Stop the engine processes now (not whenever the garbage collector gets to it), so the next
    run's engine has the memory."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def category_groups(categories: list[str] | None, n: int) -> list[tuple[str, list[int]]]:
    """[(category, prompt indices)] in order of first appearance; None: one group "default"."""
    if categories is None:
        return [("default", list(range(n)))]
    if len(categories) != n:
        raise ValueError(f"evaluate job: {len(categories)} categories for {n} prompts")
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        groups.setdefault(c, []).append(i)
    return list(groups.items())


def _counts(d: dict, prompts: int, generated: int, seconds: float) -> SpecCounts:
    return SpecCounts(prompts=prompts, generated_tokens=generated, generate_s=round(seconds, 4), drafts=d["drafts"],
                      draft_tokens=d["draft_tokens"], accepted_tokens=d["accepted"], accepted_per_position=d["per_pos"],
                      steps=d.get("steps"))


def _pass(llm, job: EvalJob, k: int, params_for, what: str) -> tuple[dict[str, SpecCounts], SpecCounts, list]:
    """One generate call per category, counters read around each: ({category: counts}, totals, outputs
    in prompt order). A long call prints a progress line every 30 s (progress.py), `what` naming the pass."""
    from vllm.inputs import TokensPrompt


    outs: list = [None] * len(job.prompts)
    per_cat: dict[str, SpecCounts] = {}
    first = before = read_spec_counters(llm.get_metrics())
    seconds = 0.0
    for cat, idx in category_groups(job.categories, len(job.prompts)):
        t = time.time()
        got = llm.generate([TokensPrompt(prompt_token_ids=job.prompts[i]) for i in idx], [params_for(i) for i in idx],
                           use_tqdm=LineProgress(f"{what}, {cat}", sum(len(job.prompts[i]) for i in idx)))
        dt = time.time() - t
        after = read_spec_counters(llm.get_metrics())
        for i, o in zip(idx, got, strict=True):
            outs[i] = o
        per_cat[cat] = _counts(_delta(after, before, k), len(idx), sum(len(o.outputs[0].token_ids) for o in got), dt)
        before, seconds = after, seconds + dt
    total = _counts(_delta(before, first, k), len(job.prompts), sum(len(o.outputs[0].token_ids) for o in outs), seconds)
    return per_cat, total, outs


def _run(job: EvalJob, run: EvalRunSpec) -> RunOutput:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt


    t0 = time.time()
    if run.ngram is not None:
        spec = ngram_config(run.num_speculative_tokens, run.ngram)
    elif run.suffix is not None:
        spec = suffix_config(run.num_speculative_tokens, run.suffix)
    else:
        spec = None if run.draft_dir is None else eagle3_config(run.draft_dir, run.num_speculative_tokens)
    llm = build_llm(job.engine, job.target, max_model_len=job.max_model_len, speculative_config=spec,
                    disable_log_stats=False)  # get_metrics() asserts that stats are on
    start_s = time.time() - t0
    emit_event(kind="engine_ready", label=run.label, seconds=round(start_s, 3))
    k = run.num_speculative_tokens
    sampled = sampled_total = None
    timed: list[TimedPass] = []
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=job.max_tokens)
        per_cat, total, outs = _pass(llm, job, k, lambda i: greedy, f"evaluate: {run.label}, greedy")
        if run.sampled and job.temperature:
            sampled, sampled_total, _ = _pass(llm, job, k, lambda i: SamplingParams(
                temperature=job.temperature, max_tokens=job.max_tokens, seed=job.seed + i),
                f"evaluate: {run.label}, temperature {job.temperature:g}")
        if run.timed:
            every = [TokensPrompt(prompt_token_ids=p) for p in job.prompts]
            llm.generate(every, greedy, use_tqdm=False)  # warm-up: the first call at this batch size is slower
            for _ in range(job.timing_rounds):
                t1 = time.time()
                got = llm.generate(every, greedy, use_tqdm=False)
                timed.append(TimedPass(generate_s=round(time.time() - t1, 5),
                                       generated_tokens=sum(len(o.outputs[0].token_ids) for o in got)))
    finally:
        _shutdown(llm)
    run_s = time.time() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    return RunOutput(
        label=run.label, draft_dir=run.draft_dir, num_speculative_tokens=k,
        engine_start_s=round(start_s, 3), generate_s=total.generate_s,
        prompt_tokens=sum(len(p) for p in job.prompts), generated_tokens=total.generated_tokens,
        drafts=total.drafts, draft_tokens=total.draft_tokens, accepted_tokens=total.accepted_tokens,
        accepted_per_position=total.accepted_per_position, steps=total.steps, ngram=run.ngram, suffix=run.suffix,
        implementation=_implementation(run), token_ids=token_ids,
        texts=[o.outputs[0].text for o in outs[: job.sample_texts]], per_category=per_cat, sampled=sampled,
        sampled_total=sampled_total, timed=timed, run_s=round(run_s, 3))


def _implementation(run: EvalRunSpec) -> Implementation | None:
    """The implementation of this run's proposer on this child's vLLM (evaluate/implementation.py)."""
    method = NGRAM if run.ngram is not None else SUFFIX if run.suffix is not None else \
        "eagle3" if run.draft_dir is not None else None
    return installed_implementation(method) if method else None


def main(argv: list[str]) -> int:
    heap.tune()  # before the imports main makes
    job = EvalJob.model_validate_json(Path(argv[0]).read_text())
    print(f"evaluate worker: VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}, "
          f"in-process engine core: {os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING') == '0'}", flush=True)


    if take_fault("evaluate"):  # test hook (faults.py): an engine start that fails once
        print("evaluate worker: injected engine start failure (EAGLE3_TEST_FAIL_ONCE)", file=sys.stderr, flush=True)
        return 3
    for run in job.runs:
        try:
            out = _run(job, run)
        except BaseException as e:
            traceback.print_exc()
            sys.stderr.flush()
            emit_event(kind="error", label=run.label, draft_dir=run.draft_dir,
                       ngram=run.ngram is not None, suffix=run.suffix is not None,
                       error=f"{type(e).__name__}: {e}"[:4000] or type(e).__name__)
            return 1
        write_json(result_path(job.out_dir, run.label), out.model_dump(mode="json"))
        rss = psutil.Process().memory_info().rss / 2**30  # after the engine's shutdown: what the next one starts with
        emit_event(kind="run_done", label=run.label, rss_gib=round(rss, 2), drafts=out.drafts, accepted=out.accepted_tokens,
                   generated_tokens=out.generated_tokens, generate_s=out.generate_s, steps=out.steps, run_s=out.run_s,
                   timed_tokens_per_s=[round(t.generated_tokens / max(t.generate_s, 1e-9), 1) for t in out.timed])
    return 0


if __name__ == "__main__":  # vLLM's spawned engine processes re-import this module: keep the work here
    from eagle3_pipeline.core.proc import exit_child

    exit_child(main(sys.argv[1:]))  # every result file is written: skip the interpreter's teardown
