"""Child for bench/extract_vs_prefill.py: plain prefill (max_tokens=1, no speculation, no connector) on
the same engine settings as the extract worker and the same requests: the rows in the extraction's
shards (`rows_per_call` each, one `generate` per shard, as the extract worker calls it) after the same
one short warm-up request; reports tokens and the summed seconds of the shard calls (engine start
excluded, as for the extraction). One generate over every row would let the first-use costs of a
large batch (memory first touched) land in one call, while the extraction's later shards reuse it."""

import json
import sys
import time

from eagle3_pipeline.core.proc import emit_event, exit_child

if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3_pipeline.core.config import EngineConfig, TargetConfig
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.engine.build import build_llm

    prompts = load_tokenized(job["tokenized"])["input_ids"][: job["rows"]]
    batched = {"max_num_batched_tokens": job["max_num_batched_tokens"]} if job.get("max_num_batched_tokens") else {}
    llm = build_llm(EngineConfig(**job["engine"]), TargetConfig(model=job["model"], dtype=job.get("dtype", "auto")),
                    max_model_len=max(map(len, prompts)) + 1, max_num_seqs=job["max_num_seqs"],
                    enable_chunked_prefill=False, enable_prefix_caching=False, **batched)
    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:1] * 2)], sp, use_tqdm=False)  # warm-up, as the worker's
    per = max(1, int(job.get("rows_per_call") or len(prompts)))
    seconds = 0.0
    for a in range(0, len(prompts), per):
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[a:a + per]], sp, use_tqdm=False)
        seconds += time.perf_counter() - t0
    emit_event(kind="prefill", tokens=sum(map(len, prompts)), seconds=seconds)
    exit_child(0)  # skip the engine teardown (seconds)
