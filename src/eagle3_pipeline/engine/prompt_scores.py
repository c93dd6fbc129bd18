"""Prompt scores for the fingerprint without vLLM's float32 copy of every prompt token's logits.

How it works, what it reads and writes, its test hooks: docs/internals.md, `engine/prompt_scores.py`.
"""

from __future__ import annotations

import logging
import os

from eagle3_pipeline.engine import runner as engine_runner
from eagle3_pipeline.engine.surface import V1

ENV = "EAGLE3_LEAN_PROMPT_SCORES"
RANKS_ENV = "EAGLE3_PROMPT_SCORE_RANKS"  # =1: the lean path counts the prompt token's rank too
NOT_COUNTED = -1  # the prompt token's rank in the lean path's output when it is not counted
RAW_MODES = ("raw_logits", "processed_logits")
_STATE = {"installed": False, "own": None}


def missing() -> list[str]:
    """What the installed vLLM lacks of what `lean_prompt_scores` reads (empty: it can run)."""
    out = []
    try:
        from vllm.v1.outputs import LogprobsTensors
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than  # noqa: F401
        from vllm.v1.worker.gpu_input_batch import CachedRequestState
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as e:
        return [f"import: {e}"]
    if not callable(getattr(GPUModelRunner, "_get_prompt_logprobs_dict", None)):
        out.append("GPUModelRunner._get_prompt_logprobs_dict")
    if not callable(getattr(LogprobsTensors, "empty_cpu", None)):
        out.append("LogprobsTensors.empty_cpu")
    fields = set(getattr(CachedRequestState, "__dataclass_fields__", {}))
    out += [f"CachedRequestState.{f}" for f in ("prompt_token_ids", "num_computed_tokens",
                                                 "in_progress_prompt_logprobs_cpu") if f not in fields]
    return out


def wanted(value: str | None = None) -> bool:
    """Whether the lean path is a hook of this engine: asked for (`value`, default EAGLE3_LEAN_PROMPT_SCORES, is
    "1") on Model Runner V1. V2's own path (PromptLogprobsWorker) already scores every request's rows together,
    1,024 rows per lm_head call, on raw logits without a float32 copy of the vocabulary: nothing to replace."""
    return (os.environ.get(ENV) if value is None else value) == "1" and engine_runner.expected() == V1


def install() -> bool:
    """Replace vLLM's prompt-scores step with `lean_prompt_scores` in this process when asked
    (EAGLE3_LEAN_PROMPT_SCORES=1) and possible (`wanted`); idempotent. Returns whether it is in place."""
    if not wanted():
        return False
    if _STATE["installed"]:
        return True
    lacks = missing()
    if lacks:

        logging.getLogger("eagle3_pipeline").warning(
            "prompt scores: vLLM's own path (%s=1, but this vLLM lacks %s)", ENV, ", ".join(lacks))
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    own = GPUModelRunner._get_prompt_logprobs_dict
    _STATE["own"] = own


    def prompt_scores(self, hidden_states, num_scheduled_tokens):
        engine_runner.mark_live("prompt_scores", self)
        if self.model_config.logprobs_mode not in RAW_MODES:
            return own(self, hidden_states, num_scheduled_tokens)
        return lean_prompt_scores(self, hidden_states, num_scheduled_tokens)

    GPUModelRunner._get_prompt_logprobs_dict = prompt_scores
    _STATE["installed"] = True
    counted = "counted" if os.environ.get(RANKS_ENV) == "1" else f"not counted ({RANKS_ENV}=1 counts it)"
    print(f"eagle3 prompt_scores: lean prompt scores in place (pid {os.getpid()}; the prompt token's rank "
          f"{counted})", flush=True)
    return True


GROUP_BYTES = 16 << 20  # logits per lm_head call in lean_prompt_scores: rows x vocabulary x itemsize


def row_groups(n_rows: int, vocab: int, itemsize: int) -> list[slice]:
    """The row ranges `lean_prompt_scores` computes logits for in one call each: GROUP_BYTES of logits
    (256 rows of a 32k vocabulary in bf16, 51 of a 160k one), at least one row."""
    per = max(1, GROUP_BYTES // max(1, vocab * itemsize))
    return [slice(a, min(n_rows, a + per)) for a in range(0, n_rows, per)]


def lean_prompt_scores(runner, hidden_states, num_scheduled_tokens: dict[str, int]) -> dict:
    """The prompt scores of this engine step for every request that asked for prompt logprobs: the
    logits of their scheduled prompt tokens (the engine's dtype), the top-k, the next prompt token's score
    (and its rank where RANKS_ENV=1, else NOT_COUNTED), into each request's CPU tensors; the finished
    requests' tensors returned.

    vLLM computes the logits request by request; this computes them for the rows of every request of
    the step together, in groups of GROUP_BYTES of logits (`row_groups`): one lm_head call per group
    instead of one per request, which reads the lm_head weights once per group rather than once per
    request (on the 602M bench target, 24 requests of ~54 tokens a step: 0.21 s against 0.40 s of
    lm_head a round), while a group's logits stay small. A row's logits are the same computation either
    way; the matmul's blocking may round a value differently by one unit of the dtype's last place."""
    from vllm.v1.outputs import LogprobsTensors

    wanted = runner.num_prompt_logprobs  # req id -> k, while the request's prompt is being scored
    if not wanted:
        return {}
    ranks = os.environ.get(RANKS_ENV) == "1"
    done: dict = {}
    plan: dict[int, list] = {}  # k -> [(its CPU tensors, first position, rows, hidden-state row, next tokens)]
    for req_id, k in list(wanted.items()):
        n = num_scheduled_tokens.get(req_id)
        req = runner.requests[req_id]
        if n is None or req.prompt_token_ids is None:  # preempted in prefill, or prompt embeddings
            continue
        prompt = req.prompt_token_ids
        into = req.in_progress_prompt_logprobs_cpu
        if into is None:
            into = req.in_progress_prompt_logprobs_cpu = LogprobsTensors.empty_cpu(len(prompt) - 1, k + 1)
        first = req.num_computed_tokens  # scores of positions first.. predict tokens first+1..
        left = len(prompt) - 1 - first
        if n > left:  # the prompt's last scheduled chunk: its scores go out after this step
            done[req_id] = into
        m = min(n, left)
        if m > 0:
            at = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]])
            plan.setdefault(k, []).append((into, first, m, at, prompt[first + 1:first + 1 + m]))
    vocab = vocab_size(runner)
    for k, part in plan.items():
        _score_rows(runner, hidden_states, part, k, vocab, ranks)
    for req_id in done:
        del wanted[req_id]
        runner.requests[req_id].in_progress_prompt_logprobs_cpu = None
    if done and hasattr(runner, "_sync_device"):  # the copies above are asynchronous on a GPU
        runner._sync_device()
    return done


def _score_rows(runner, hidden_states, part: list, k: int, vocab: int | None, ranks: bool) -> None:
    """For the requests of `part` (each: its CPU tensors, first position, rows, hidden-state row, next
    prompt tokens) that asked for k scores: their scored rows' logits in row groups, the top-k, the next
    token's score (and rank where `ranks`), copied into each request's tensors at its positions."""
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    device = hidden_states.device
    nxt = torch.tensor([t for *_, ids in part for t in ids], dtype=torch.int64, device=device)  # [N]
    ids = torch.empty(len(nxt), k + 1, dtype=torch.int64, device=device)
    scores = torch.empty(len(nxt), k + 1, dtype=torch.float32, device=device)
    counted = torch.full((len(nxt),), NOT_COUNTED, dtype=torch.int64, device=device)
    for g, logits in grouped_logits(runner, hidden_states, [(at, m) for _, _, m, at, _ in part], vocab):
        top_v, top_i = top_k(logits, k)
        nxt_v = logits.gather(-1, nxt[g].unsqueeze(-1))  # [rows, 1]
        ids[g, 0], ids[g, 1:] = nxt[g], top_i
        scores[g, :1], scores[g, 1:] = nxt_v, top_v
        if ranks:
            counted[g] = count_at_least(logits, nxt_v, batched_count_greater_than)
    o = 0
    for into, first, m, _, _ in part:
        at_rows = slice(first, first + m)
        into.logprob_token_ids[at_rows].copy_(ids[o:o + m], non_blocking=True)
        into.logprobs[at_rows].copy_(scores[o:o + m], non_blocking=True)
        into.selected_token_ranks[at_rows].copy_(counted[o:o + m], non_blocking=True)
        o += m


def grouped_logits(runner, hidden_states, spans: list[tuple[int, int]], vocab: int | None):
    """(rows, logits) for the hidden-state rows of `spans` ((first row, rows) each, taken in order as one
    run of rows): the engine's own compute_logits in `row_groups` (one group where `vocab` is unknown)."""
    import torch

    rows = torch.cat([torch.arange(at, at + m) for at, m in spans]).to(hidden_states.device)
    h = hidden_states.index_select(0, rows)  # [N, H]
    groups = row_groups(len(rows), vocab, hidden_states.element_size()) if vocab else [slice(0, len(rows))]
    for g in groups:
        yield g, runner.model.compute_logits(h[g])  # [rows, V]


def vocab_size(runner) -> int | None:
    """The target's vocabulary size (None where this vLLM's model config does not say: one group)."""
    try:
        return int(runner.model_config.get_vocab_size())
    except Exception:  # noqa: BLE001 - a vLLM without it scores every row in one call
        return None


TOP_BLOCK = 256  # vocabulary entries per block in top_k (see top_k)
_BITS = {"torch.bfloat16": "int16", "torch.float16": "int16", "torch.float32": "int32"}


def top_k(logits, k: int):
    """`torch.topk(logits, k, dim=-1)` on CPU by blocks of TOP_BLOCK entries: each whole block's max, the k
    blocks with the largest maxima (the k largest entries outside the last, shorter block lie in them),
    then the top-k of those blocks' entries and the short block's. The same values as torch.topk; where
    values tie, the ids may be others of the same value (torch.topk's order among ties is unspecified, and
    the fingerprint compares margins, which ties leave at 0).

    The block maxima are taken on the logits' bits read as integers of their width (int16 for bf16 and
    fp16, int32 for fp32): a reduction over integers, 2-3x faster here than over bf16. Among values whose
    sign bit is clear (+0, positive, +inf, +NaN) the integers order as the values do, and every such value
    is above every value whose sign bit is set, so a block's integer max is its largest value >= +0 and the
    k best blocks hold the row's k largest values wherever k blocks hold one. Rows where fewer do (every
    logit negative: logits usually have positive tops) take torch.topk. The one difference from torch.topk:
    a NaN with its sign bit set (what x86 arithmetic makes of an invalid operation) in a row that also
    holds k values >= +0 is not ranked first; a row whose logits are all NaN is ranked as torch.topk
    ranks it. Blocks of 256 keep the steps after the max under PyTorch's parallel grain (the engine's
    threads sleep between ops, OMP_WAIT_POLICY=PASSIVE, and each wake-up costs more than a small op).
    Measured on 2 cores, passive threads, a 32k vocabulary in bf16: 0.44 ms against torch.topk's 1.14
    (54 rows) and 2.5 ms against 10.0 (500 rows). On other devices, other dtypes, or a vocabulary under
    4 * k blocks: torch.topk."""
    import torch

    m_rows, vocab = logits.shape
    bits = _BITS.get(str(logits.dtype))
    if logits.device.type != "cpu" or bits is None or vocab < 4 * k * TOP_BLOCK:
        return torch.topk(logits, k, dim=-1)
    whole = vocab // TOP_BLOCK
    shape, strides = (m_rows, whole, TOP_BLOCK), (logits.stride(0), TOP_BLOCK, logits.stride(1))
    # the whole blocks as views (no copy, also where the vocabulary ends in a short block)
    as_int = logits.view(getattr(torch, bits)).as_strided(shape, strides)
    best = torch.topk(as_int.amax(-1), k, dim=-1)  # [m, k]: the blocks of the k largest maxima >= +0
    blocks = best.indices
    blocked = logits.as_strided(shape, strides)
    vals = blocked.gather(1, blocks.unsqueeze(-1).expand(m_rows, k, TOP_BLOCK)).view(m_rows, -1)  # [m, k * B]
    if vocab > whole * TOP_BLOCK:  # the short block's entries are candidates too
        vals = torch.cat((vals, logits[:, whole * TOP_BLOCK:]), 1)
    top_v, at = torch.topk(vals, k, dim=-1)
    in_blocks = at < k * TOP_BLOCK
    ids = torch.where(in_blocks, blocks.gather(1, (at // TOP_BLOCK).clamp(max=k - 1)) * TOP_BLOCK + at % TOP_BLOCK,
                      at - k * TOP_BLOCK + whole * TOP_BLOCK)
    short = best.values[:, -1] < 0  # rows with fewer than k blocks holding a value >= +0
    if bool(short.any()):
        rows = short.nonzero().squeeze(-1)
        own = torch.topk(logits.index_select(0, rows), k, dim=-1)
        top_v[rows], ids[rows] = own.values, own.indices
    return top_v, ids


COUNT_ROWS = 32  # rows of logits per comparison in count_at_least (32 x 32k bf16: 2 MB)


def count_at_least(logits, values, compiled):
    """`(logits >= values).sum(-1)` per row, as int64: the scored token's rank as vLLM counts it. vLLM's
    `compiled` (batched_count_greater_than) is one fused kernel under torch.compile; where the engine runs
    eager (TORCHDYNAMO_DISABLE, which extract's CPU engines set) that function falls back to a [m, V]
    bool tensor summed into int64, which cost the extract engine 38% of its lm_head at the 602M bench size.
    Then: the same comparison in blocks of COUNT_ROWS rows, summed into int32 (a vocabulary fits)."""
    import torch

    if logits.device.type != "cpu" or not _dynamo_disabled():
        return compiled(logits, values)
    out = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
    for a in range(0, logits.shape[0], COUNT_ROWS):
        torch.sum(torch.ge(logits[a:a + COUNT_ROWS], values[a:a + COUNT_ROWS]), -1, dtype=torch.int32,
                  out=out[a:a + COUNT_ROWS])
    return out.to(torch.int64)


def _dynamo_disabled() -> bool:
    import torch

    return os.environ.get("TORCHDYNAMO_DISABLE") == "1" or bool(getattr(torch._dynamo.config, "disable", False))
