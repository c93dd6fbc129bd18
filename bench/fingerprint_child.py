"""Child for bench/fingerprint_cost.py: one engine (no speculation, no connector: the fingerprint's own
cost), the rows prefilled with and without prompt logprobs in alternating rounds (the order flips each
round); `logprobs_mode` from the job. Reports the seconds of every timed call (engine start excluded)."""

import json
import sys
import time

from eagle3_pipeline.proc import emit_event, exit_child

if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    from eagle3_pipeline.config import EngineConfig, TargetConfig
    from eagle3_pipeline.contracts import FP_TOP
    from eagle3_pipeline.data.prepare import load_tokenized
    from eagle3_pipeline.engine import build_llm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rows = load_tokenized(job["tokenized"])["input_ids"][: job["rows"]]
    llm = build_llm(EngineConfig(**job["engine"]), TargetConfig(model=job["model"]),
                    max_model_len=max(map(len, rows)) + 1, max_num_seqs=job["max_num_seqs"],
                    enable_chunked_prefill=False, enable_prefix_caching=False, logprobs_mode=job["logprobs_mode"])
    plain = SamplingParams(max_tokens=1, temperature=0)
    # what the extract worker asks for (extract/worker.py _Engine)
    fp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=FP_TOP, logprobs=FP_TOP, detokenize=False,
                        flat_logprobs=True)
    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
    per = max(1, int(job["rows_per_call"]))
    llm.generate(prompts[:2], fp, use_tqdm=False)  # first-use costs: start-up, not a round's
    seconds: dict[str, list[float]] = {"plain": [], "fingerprint": []}
    for r in range(int(job["rounds"])):
        order = (("plain", plain), ("fingerprint", fp))
        for name, sp in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            for a in range(0, len(prompts), per):
                llm.generate(prompts[a:a + per], sp, use_tqdm=False)
            seconds[name].append(time.perf_counter() - t0)
    emit_event(kind="fingerprint_cost", tokens=sum(map(len, rows)), seconds=seconds)
    exit_child(0)
