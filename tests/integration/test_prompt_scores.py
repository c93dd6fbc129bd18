"""The extract engine's lean prompt scores (prompt_scores.py) against vLLM's own path, on the real engine.

One child process per target (this file run as a script) starts an in-process engine with the pipeline's
score mode (raw logits) and prompt-logprob requests as the extract worker makes them, and prefills the
same rows three times: vLLM's own prompt-scores step, `lean_prompt_scores` as the pipeline runs it (the
scored token's rank uncounted) and with ranks counted; chunked prefill with a small token budget, so short
prompts are scored in one engine step and long ones over several; the lean path's row groups made 5 rows
long, so that a group holds rows of several requests and a request's rows fall in several groups. The tests then compare, without an
engine: every position's ids, scores and ranks must be equal (but the uncounted ranks), and the lean path
must have run.
Targets: the tiny Llama (bf16, so the float32 copy it skips is a real cast) and the tiny MoE (MLA + MoE,
bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
N_ROWS = 12
CHUNK_TOKENS = 32  # chunked prefill's token budget: longer rows are scored over several steps

pytestmark = pytest.mark.timeout(900)


def _child(target: str, trust: bool, out_dir: str) -> None:
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core_client import InprocClient

    from eagle3_pipeline.core.config import EngineConfig, TargetConfig
    from eagle3_pipeline.engine import prompt_scores
    from eagle3_pipeline.engine.build import FINGERPRINT_ENGINE_KWARGS, build_llm
    from eagle3_pipeline.records.contracts import FP_TOP

    assert prompt_scores.install(), "EAGLE3_LEAN_PROMPT_SCORES=1 and a known vLLM: the lean path must install"
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    installed, own = GPUModelRunner._get_prompt_logprobs_dict, prompt_scores._STATE["own"]
    lean_steps = []
    # the tiny vocabularies (908, 1024) are under the block top-k's minimum at TOP_BLOCK 512: smaller
    # blocks, a short last one included, so that the engine's real logits go through it
    prompt_scores.TOP_BLOCK = 64
    by_blocks, blocks = {"calls": 0, "rows": 0, "tied_ids": 0, "wrong": 0}, prompt_scores.top_k

    def checked_top_k(logits, k):
        v, i = blocks(logits, k)
        want = torch.topk(logits, k, dim=-1)
        by_blocks["calls"] += 1
        by_blocks["rows"] += logits.shape[0]
        by_blocks["wrong"] += int((~torch.eq(v, want.values)).any(-1).sum() + (logits.gather(-1, i) != v).any(-1).sum())
        by_blocks["tied_ids"] += int((i != want.indices).any(-1).sum())  # the same values: ties
        return v, i

    prompt_scores.top_k = checked_top_k
    # row groups of 5 rows of the tiny vocabularies (a group spans requests, a request spans groups)
    grouped, groups = {"steps": 0, "most_groups": 0, "most_rows": 0}, prompt_scores.row_groups

    def counted_groups(n_rows, vocab, itemsize):
        prompt_scores.GROUP_BYTES = 5 * vocab * itemsize
        out = groups(n_rows, vocab, itemsize)
        assert [g.start for g in out] == list(range(0, n_rows, 5)) and out[-1].stop == n_rows
        grouped["steps"] += 1
        grouped["most_groups"], grouped["most_rows"] = max(grouped["most_groups"], len(out)), max(grouped["most_rows"], n_rows)
        return out

    prompt_scores.row_groups = counted_groups

    def counted(self, hidden_states, num_scheduled_tokens):
        if self.num_prompt_logprobs:
            lean_steps.append(len(num_scheduled_tokens))
        return installed(self, hidden_states, num_scheduled_tokens)

    tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust)
    texts = [" ".join(f"w{i * j % 97}" for j in range(1 + 7 * i)) for i in range(N_ROWS)]
    rows = [(tok(t)["input_ids"] * 2)[: 3 * CHUNK_TOKENS] for t in texts]  # 2 tokens up to 3 budgets
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=FP_TOP, logprobs=FP_TOP,
                        detokenize=False, flat_logprobs=True)
    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
    # chunked prefill with a small budget: short rows are scored in one step, long ones over several
    llm = build_llm(EngineConfig(), TargetConfig(model=target, trust_remote_code=trust),
                    max_model_len=4 * CHUNK_TOKENS, max_num_seqs=4, enable_prefix_caching=False,
                    enable_chunked_prefill=True, max_num_batched_tokens=CHUNK_TOKENS, **FINGERPRINT_ENGINE_KWARGS)
    assert isinstance(llm.llm_engine.engine_core, InprocClient)
    res: dict = {"lengths": [len(r) for r in rows]}
    for name, step, ranks in (("vllm", own, "0"), ("lean", counted, "0"), ("lean_ranks", counted, "1")):
        GPUModelRunner._get_prompt_logprobs_dict = step
        os.environ[prompt_scores.RANKS_ENV] = ranks
        outs = llm.generate(prompts, sp, use_tqdm=False)
        res[name] = [{"ids": list(o.prompt_logprobs.token_ids), "scores": list(o.prompt_logprobs.logprobs),
                      "ranks": list(o.prompt_logprobs.ranks), "starts": list(o.prompt_logprobs.start_indices)}
                     for o in outs]
    res["lean_steps"] = len(lean_steps)
    res["by_blocks"] = by_blocks
    res["grouped"] = grouped
    Path(out_dir, "result.json").write_text(json.dumps(res))


TARGETS = {"tiny-target": ("tiny_target", False), "tiny-moe": ("tiny_moe_target", True)}


@pytest.fixture(scope="module", params=list(TARGETS))
def scored(request, tmp_path_factory):
    from eagle3_pipeline.core.config import EngineConfig
    from eagle3_pipeline.engine.build import engine_env

    fixture, trust = TARGETS[request.param]
    target = request.getfixturevalue(fixture)
    out = tmp_path_factory.mktemp(f"prompt-scores-{request.param}")
    env = {**os.environ, **engine_env(EngineConfig()), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "EAGLE3_LEAN_PROMPT_SCORES": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(target), json.dumps(trust), str(out)],
                          env=env, capture_output=True, text=True, timeout=800)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine child failed (rc {proc.returncode}):\n{log[-6000:]}"
    return json.loads((out / "result.json").read_text())


def test_lean_prompt_scores_equal_vllms_own(scored):
    """Every prompt position: the same top-2 ids and raw-logit scores, the same scored token, score and
    rank as vLLM's own path, for prompts scored in one step and over several (chunked prefill), where the
    lean path counts ranks (EAGLE3_PROMPT_SCORE_RANKS=1). By default it leaves the scored token's rank
    uncounted (-1, the fingerprint never reads it) and everything else equal, the top-k ranks included."""
    from eagle3_pipeline.engine.prompt_scores import NOT_COUNTED

    lengths = scored["lengths"]
    assert min(lengths) < CHUNK_TOKENS < 2 * CHUNK_TOKENS < max(lengths)  # one step and several
    assert scored["lean_steps"] > 0, "the lean path never ran"
    vllm, lean, lean_ranks = scored["vllm"], scored["lean"], scored["lean_ranks"]
    assert len(vllm) == len(lean) == len(lean_ranks) == N_ROWS
    blocks = scored["by_blocks"]  # the block top-k ran on every scored row, with torch.topk's values
    assert blocks["calls"] > 0 and blocks["rows"] >= 2 * sum(n - 1 for n in lengths) and blocks["wrong"] == 0, blocks
    # the lean path scored the rows of a step's requests together, in groups of 5 rows: many groups a step
    assert scored["grouped"]["most_groups"] >= 4 and scored["grouped"]["most_rows"] > CHUNK_TOKENS // 2, scored["grouped"]
    tied = 0
    for i, (a, b, c) in enumerate(zip(vllm, lean, lean_ranks)):
        assert len(a["starts"]) == lengths[i], f"row {i}: {len(a['starts'])} positions, expected {lengths[i]}"
        for other in (b, c):
            assert a["starts"] == other["starts"], f"row {i}: positions differ"
            assert a["scores"] == other["scores"], f"row {i}: scores differ"
            # ids: the same but where top_k chose another id of a tied value (counted in the child)
            tied += sum(x != y for x, y in zip(a["ids"], other["ids"]))
        assert b["ids"] == c["ids"], f"row {i}: the lean path's ids differ between its runs"
        assert a["ranks"] == c["ranks"], f"row {i}: ranks differ"
        scored_at = set(a["starts"][1:])  # each position's first entry: the scored prompt token
        assert all(r >= 1 for r in a["ranks"])
        assert [NOT_COUNTED if j in scored_at else r for j, r in enumerate(a["ranks"])] == b["ranks"], \
            f"row {i}: the lean path's ranks differ beyond the uncounted scored-token ranks"
    assert tied <= 2 * blocks["tied_ids"], f"{tied} ids differ from vLLM's, {blocks['tied_ids']} rows with tied ids"


def test_install_only_when_asked(monkeypatch):
    """The plugin replaces nothing unless the process asks (EAGLE3_LEAN_PROMPT_SCORES=1): vLLM loads it
    in every engine, evaluate's and the online server's included."""
    from eagle3_pipeline.engine import prompt_scores

    assert prompt_scores.missing() == []  # the installed vLLM has everything the lean path reads
    monkeypatch.delenv(prompt_scores.ENV, raising=False)
    assert prompt_scores.install() is False
    monkeypatch.setenv(prompt_scores.ENV, "0")
    assert prompt_scores.install() is False



def test_top_k_by_blocks_equals_torch_topk(monkeypatch):
    """prompt_scores.top_k: torch.topk's values on every row, ids that hold those values and are distinct,
    and torch.topk's ids wherever no value ties; bf16, fp16 and fp32 (block maxima on the bits as
    integers); vocabularies with and without a short last block, k 1 to 3, many ties (rounded values),
    rows of -inf, +inf and NaN of either sign, rows whose values are all negative or have fewer than k
    blocks holding a value >= +0 (torch.topk for those rows), +0 and -0."""
    import torch

    from eagle3_pipeline.engine import prompt_scores

    g = torch.Generator().manual_seed(0)
    neg_nan = -torch.tensor(float("nan"))
    assert neg_nan.view(torch.int32) < 0  # its sign bit is set
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for vocab in (4 * 3 * prompt_scores.TOP_BLOCK, 32000, 49152, 50257):
            for k in (1, 2, 3):
                for step in (None, 0.25):
                    x = torch.randn(64, vocab, generator=g)
                    x = (x / step).round() * step if step else x
                    x = x.to(dtype)
                    x[0], x[1, 7:], x[2, -1], x[3, 100] = float("-inf"), float("-inf"), float("inf"), float("nan")
                    x[4] = -x[4].abs() - 1  # every value negative
                    x[5] = -x[5].abs() - 1
                    x[5, 3] = 2.0  # one block holds a value >= +0
                    x[6], x[7] = float("nan"), neg_nan.to(dtype)  # all NaN, of either sign
                    x[8] = 0.0
                    x[8, ::2] = -0.0
                    want = torch.topk(x, k, dim=-1)
                    v, i = prompt_scores.top_k(x, k)
                    assert torch.equal(v.nan_to_num(), want.values.nan_to_num()), (dtype, vocab, k, step)
                    assert torch.equal(x.gather(-1, i).nan_to_num(), v.nan_to_num()) and (i < vocab).all()
                    assert (i.sort(-1).values.diff(dim=-1) > 0).all()  # distinct ids
                    top = torch.topk(x.float(), k + 1, dim=-1).values
                    untied = (top.diff(dim=-1) < 0).all(-1)  # rows whose k + 1 largest values all differ
                    assert torch.equal(i[untied], want.indices[untied]), (dtype, vocab, k, step)
    calls = []
    monkeypatch.setattr(torch, "topk", lambda *a, **kw: calls.append(1) or torch.return_types.topk(
        (a[0][..., :1], a[0][..., :1].long())))
    prompt_scores.top_k(torch.zeros(2, 4 * 2 * prompt_scores.TOP_BLOCK - 1), 2)
    assert len(calls) == 1  # under 4 * k blocks: torch.topk itself


def test_rank_count_in_blocks_equals_vllms(monkeypatch):
    """Where the engine runs eager, the scored token's rank is counted in blocks of rows into int32
    (prompt_scores.count_at_least): the same counts as vLLM's batched_count_greater_than on every row,
    across block boundaries, with ties, -inf and a NaN score (counted as nothing, as vLLM does)."""
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from eagle3_pipeline.engine import prompt_scores

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    called = []
    spy = lambda x, v: called.append(1) or batched_count_greater_than(x, v)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    for m in (1, prompt_scores.COUNT_ROWS - 1, prompt_scores.COUNT_ROWS, 2 * prompt_scores.COUNT_ROWS + 3):
        x = torch.randn(m, 999, generator=g).to(torch.bfloat16)  # bf16 rounding: many ties
        x[0, :7] = float("-inf")
        v = x[:, 5:6].clone()
        v[-1, 0] = float("nan")
        got = prompt_scores.count_at_least(x, v, spy)
        want = (x >= v).sum(-1)
        assert got.dtype == torch.int64 and torch.equal(got, want), m
    assert called == []  # the blocks did the counting, not vLLM's eager fallback
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    prompt_scores.count_at_least(x, v, spy)
    assert called == [1]  # compiled: vLLM's own kernel


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
