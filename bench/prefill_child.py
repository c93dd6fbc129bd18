"""Child for bench/extract_vs_prefill.py: plain prefill (max_tokens=1, no speculation, no connector) on
the same engine settings as the extract worker; reports tokens and seconds (engine start excluded)."""

import json
import sys
import time

from eagle3_pipeline.proc import emit_event, exit_child

if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    from eagle3_pipeline.config import EngineConfig, TargetConfig
    from eagle3_pipeline.data.prepare import load_tokenized
    from eagle3_pipeline.engine import build_llm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = load_tokenized(job["tokenized"])["input_ids"][: job["rows"]]
    llm = build_llm(EngineConfig(**job["engine"]), TargetConfig(model=job["model"]),
                    max_model_len=max(map(len, prompts)) + 8, max_num_seqs=job["max_num_seqs"],
                    enable_chunked_prefill=False, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    emit_event(kind="prefill", tokens=sum(map(len, prompts)), seconds=time.perf_counter() - t0)
    exit_child(0)  # skip the engine teardown (seconds)
