"""Child for bench/fingerprint_cost.py: one in-process engine (no speculation, no connector: the
fingerprint's own cost) prefills the rows five ways, alternating call by call (each shard-sized call
five times, the order rotating each round); `logprobs_mode` from the job:
- plain: what the engine does without a fingerprint (logits of each request's last token only);
- lm_head: plain, plus the engine's own `compute_logits` over every scored prompt token (each but the
  last), request by request as vLLM's prompt-scores step computes them, discarded: the floor of vLLM's
  fingerprint, measured on this engine rather than estimated from multiply-adds;
- lm_head_groups: the same logits computed as the lean path computes them, the rows of every request of
  the step together in `prompt_scores.row_groups`: the floor of the pipeline's fingerprint;
- fingerprint: what the extract worker asks for (extract/worker.py _Engine), scored as the worker's engine
  scores it (prompt_scores.py: the lean path where it installs);
- fingerprint_vllm: the same request scored by vLLM's own prompt-scores step.
Reports the seconds of every timed call (engine start excluded), the part of them spent inside the engine's
prompt-scores step (where the arms differ in work; the rest of the engine does the same for all but the
output bookkeeping of the scores), and whether the lean path was in place."""

import json
import os
import sys
import time

from eagle3_pipeline.core.proc import emit_event, exit_child

ARMS = ("plain", "lm_head", "lm_head_groups", "fingerprint", "fingerprint_vllm")


def hook_arms(switch: dict) -> list[int]:
    """The engine's prompt-scores step per arm (switch["arm"]): for "lm_head", the model's compute_logits
    over the scored tokens of each engine step (every scheduled prompt token but a prompt's last), one
    request's tokens at a time as vLLM's step does; for "lm_head_groups", over the same rows in the lean
    path's groups (vLLM calls that step whether or not a request asked for prompt logprobs); for
    "fingerprint_vllm", vLLM's own step; otherwise the pipeline's (prompt_scores.py: the lean path where
    it installs). Returns the list of row counts the lm_head arms ran on, to prove they measured something."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from eagle3_pipeline.engine import prompt_scores

    os.environ[prompt_scores.ENV] = "1"
    lean = prompt_scores.install()
    pipeline = GPUModelRunner._get_prompt_logprobs_dict
    own = prompt_scores._STATE["own"] if lean else pipeline
    ran: list[int] = []

    def scored_rows(self, num_scheduled_tokens) -> list[tuple[int, int]]:
        out = []
        for req_id, n in num_scheduled_tokens.items():
            req = self.requests[req_id]
            m = min(n, len(req.prompt_token_ids) - 1 - req.num_computed_tokens)
            if m > 0:
                out.append((int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]]), m))
        return out

    def step(self, hidden_states, num_scheduled_tokens):
        t0 = time.perf_counter()
        try:
            if switch["arm"] == "lm_head":
                for at, m in scored_rows(self, num_scheduled_tokens):
                    self.model.compute_logits(hidden_states[at:at + m])
                    ran.append(m)
            elif switch["arm"] == "lm_head_groups" and (spans := scored_rows(self, num_scheduled_tokens)):
                for g, _ in prompt_scores.grouped_logits(self, hidden_states, spans, prompt_scores.vocab_size(self)):
                    ran.append(g.stop - g.start)
            if switch["arm"] == "fingerprint_vllm":
                return own(self, hidden_states, num_scheduled_tokens)
            return pipeline(self, hidden_states, num_scheduled_tokens)
        finally:  # CPU work is synchronous: the step's own seconds, apart from the rest of the engine's
            if switch["arm"] in switch["in_step"]:
                switch["in_step"][switch["arm"]] += time.perf_counter() - t0

    GPUModelRunner._get_prompt_logprobs_dict = step
    switch["lean"] = lean
    return ran


if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core_client import InprocClient

    from eagle3_pipeline.core.config import EngineConfig, TargetConfig
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.engine.build import build_llm
    from eagle3_pipeline.records.contracts import FP_TOP

    rows = load_tokenized(job["tokenized"])["input_ids"][: job["rows"]]
    switch = {"arm": None, "in_step": dict.fromkeys(ARMS, 0.0)}
    ran = hook_arms(switch)
    llm = build_llm(EngineConfig(**job["engine"]), TargetConfig(model=job["model"]),
                    max_model_len=max(map(len, rows)) + 1, max_num_seqs=job["max_num_seqs"],
                    enable_chunked_prefill=False, enable_prefix_caching=False, logprobs_mode=job["logprobs_mode"])
    if not isinstance(llm.llm_engine.engine_core, InprocClient):
        raise SystemExit("the lm_head arm needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    plain = SamplingParams(max_tokens=1, temperature=0)
    fp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=FP_TOP, logprobs=FP_TOP, detokenize=False,
                        flat_logprobs=True)
    params = {"plain": plain, "lm_head": plain, "lm_head_groups": plain, "fingerprint": fp, "fingerprint_vllm": fp}
    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
    per = max(1, int(job["rows_per_call"]))
    llm.generate(prompts[:2], fp, use_tqdm=False)  # first-use costs: start-up, not a round's
    for arm in ARMS:  # every arm's first-use costs (torch.compile of the rank count per dtype) before timing
        switch["arm"] = arm
        llm.generate(prompts[:2], params[arm], use_tqdm=False)
    switch["arm"] = None
    if not ran:
        raise SystemExit("the lm_head hook never ran: vLLM no longer calls _get_prompt_logprobs_dict each step")
    ran.clear()
    seconds: dict[str, list[float]] = {a: [] for a in ARMS}
    in_step: dict[str, list[float]] = {a: [] for a in ARMS}  # of those, inside the prompt-scores step
    switch["in_step"] = dict.fromkeys(ARMS, 0.0)
    for r in range(int(job["rounds"])):
        spent = dict.fromkeys(ARMS, 0.0)
        for a in range(0, len(prompts), per):  # the arms alternate call by call: drift hits them alike
            for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                switch["arm"] = arm
                t0 = time.perf_counter()
                llm.generate(prompts[a:a + per], params[arm], use_tqdm=False)
                spent[arm] += time.perf_counter() - t0
        switch["arm"] = None
        for arm in ARMS:
            seconds[arm].append(spent[arm])
            in_step[arm].append(switch["in_step"][arm])
            switch["in_step"][arm] = 0.0
    tokens = sum(map(len, rows))
    per_round = sum(ran) / int(job["rounds"])
    if per_round != 2 * (tokens - len(rows)):  # every scored prompt token went through lm_head in both arms
        raise SystemExit(f"the lm_head arms ran on {per_round:.0f} rows per round, expected {2 * (tokens - len(rows))}")
    emit_event(kind="fingerprint_cost", tokens=tokens, seconds=seconds, in_step=in_step, lean=switch["lean"])
    exit_child(0)
