"""The final-layer fingerprint check, shared by verify (every record) and online training (every row the
server sends). Every row, final layer: the stored final hidden state must reproduce the target's own logits.

More: docs/internals.md, "checks/final_layer.py".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eagle3_pipeline.records.contracts import FP_IDS_KEY, FP_LOGPROBS_KEY

NORM_SUFFIXES = ("model.norm.weight", "norm.weight")  # the final norm (never a layer's: those have "layers.")
HEAD_SUFFIXES = ("lm_head.weight", "output.weight")
EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "tok_embeddings.weight")
# fp8 storage: the final-layer fingerprint's logit tolerance this many times looser (verify/invariance.py has its own,
# for states)
FP8_SLACK = 8.0
MAX_NAMED = 8  # disagreeing token positions named in a problem


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index (sharded checkpoints) or the files' headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / v for k, v in wm.items()}
    from safetensors import safe_open

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update(dict.fromkeys(st.keys(), f))
    return out


def _find(names: list[str], suffixes: tuple[str, ...]) -> str | None:
    for suf in suffixes:
        hits = sorted(n for n in names if n.endswith(suf) and ".layers." not in n and "mtp" not in n
                      and "vision" not in n and "visual" not in n)
        if hits:
            return min(hits, key=len)
    return None


class FinalLayerCheck:
    """The final norm + lm_head of a target, loaded once; `agreement_many` checks records against their fingerprints."""

    def __init__(self, model_dir: str | Path, eps: float, atol: float, rtol: float, slack: float = 1.0,
                 stol: float = 0.02):
        import torch
        from safetensors import safe_open

        model_dir = Path(model_dir)
        files = _weight_files(model_dir)
        norm, head = _find(list(files), NORM_SUFFIXES), _find(list(files), HEAD_SUFFIXES)
        head = head or _find(list(files), EMBED_SUFFIXES)  # tied embeddings
        if norm is None or head is None:
            raise ValueError(f"{model_dir}: no final norm / lm_head among {len(files)} checkpoint tensors "
                             f"(looked for *{NORM_SUFFIXES[0]} and *{HEAD_SUFFIXES[0]})")
        self.names = (norm, head)
        with safe_open(str(files[norm]), framework="pt") as f:
            self.norm = f.get_tensor(norm).float()  # [H]
        with safe_open(str(files[head]), framework="pt") as f:
            self.head = f.get_tensor(head)  # [V, H], kept in the checkpoint's dtype; rows gathered per record
        self.eps, self.atol, self.rtol, self.stol = float(eps), atol * slack, rtol * slack, stol * slack
        self.torch = torch

    def agreement_many(self, records: list[tuple]) -> list[tuple[float, int, list[int], float]]:
        """Per record (h_final fp32 [T, H]: the stored final-layer state, fingerprint: the sidecar's
        tensors): (fraction of tokens that agree, tokens compared, the first MAX_NAMED disagreeing
        token positions, the largest |margin error| / tolerance over the compared tokens: the clean margin,
        1.0 = at the tolerance)."""
        torch = self.torch
        hs, ids_, lps_, lens = [], [], [], []
        for h_final, fingerprint in records:
            ids, lps = fingerprint[FP_IDS_KEY], fingerprint[FP_LOGPROBS_KEY].float()  # [T, 2], [T, 2]
            T = min(h_final.shape[0], ids.shape[0])
            hs.append(h_final[:T].float())
            ids_.append(ids[:T])
            lps_.append(lps[:T])
            lens.append(T)
        return self.agreement_arrays(torch.cat(hs), torch.cat(ids_), torch.cat(lps_), lens)

    def next_gaps(self, h, top1, nxt, block: int = 2048):
        """Per token, how far below its own first choice the target scores the row's actual next token:
        logit(next) - logit(top1) (a log-probability ratio, <= 0 up to rounding; the log-softmax normaliser
        cancels, so two lm_head rows per token), from the stored final-layer state h fp32 [N, H], the
        fingerprint's first choice top1 int64 [N] and the next token nxt int64 [N] (-1: none). fp32 [N], NaN
        where either id is missing. What verify/row_signal.py judges rows by."""
        torch = self.torch
        N, V = h.shape[0], self.head.shape[0]
        out = torch.full((N,), float("nan"), dtype=torch.float32)
        valid = (top1 >= 0) & (nxt >= 0) & (top1 < V) & (nxt < V)
        for a in range(0, N, block):
            b = min(N, a + block)
            x = h[a:b]
            n = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.norm  # [m, H]
            pair = torch.stack([nxt[a:b], top1[a:b]], dim=-1).clamp(0, V - 1)  # [m, 2]
            logits = torch.bmm(self.head[pair].float(), n.unsqueeze(-1)).squeeze(-1)  # [m, 2]
            out[a:b] = torch.where(valid[a:b], logits[:, 0] - logits[:, 1], out[a:b])
        return out

    def agreement_arrays(self, h, ids, lps, lens: list[int], block: int = 2048) -> list[tuple[float, int, list[int], float]]:
        """The same for records laid end to end: h fp32 [N, H], ids int64 [N, 2], lps fp32 [N, 2],
        record i the next lens[i] rows. Rows whose ids are -1 or logprobs not finite are not compared.
        Done `block` tokens at a time (the gathered lm_head rows stay in cache), in one set of tensor
        operations per block for all the records: per record they cost more in call overhead than in
        arithmetic on small records."""
        torch = self.torch
        N, V = h.shape[0], self.head.shape[0]
        valid = (ids >= 0).all(dim=-1) & torch.isfinite(lps).all(dim=-1) & (ids < V).all(dim=-1)  # [N]
        ok = torch.empty(N, dtype=torch.bool)
        ratio = torch.zeros(N, dtype=torch.float32)
        for a in range(0, N, block):
            b = min(N, a + block)
            x = h[a:b]
            n = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.norm  # [m, H]
            w = self.head[ids[a:b].clamp(0, V - 1)].float()  # [m, 2, H]
            logits = torch.bmm(w, n.unsqueeze(-1)).squeeze(-1)  # [m, 2]
            margin, stored = logits[:, 0] - logits[:, 1], lps[a:b, 0] - lps[a:b, 1]  # [m]
            # vLLM's logits are bf16: each carries a rounding error ~2^-8 of its magnitude; the stored state
            # is rounded to bf16 element by element: the margin moves by up to ~2^-8 x ||(w1 - w2) * n||
            spread = ((w[:, 0] - w[:, 1]) * n).norm(dim=-1)  # [m]
            tol = self.atol + self.rtol * logits.abs().sum(dim=-1) + self.stol * spread
            err = (margin - stored).abs()
            ok[a:b] = err <= tol
            ratio[a:b] = torch.nan_to_num(err / tol, nan=0.0, posinf=1e9)
        valid_np, bad_np = valid.numpy(), (valid & ~ok).numpy()
        ratio_np = torch.where(valid, ratio, torch.zeros_like(ratio)).numpy()
        out, o = [], 0
        for T in lens:
            checked = int(valid_np[o:o + T].sum())
            if not checked:
                out.append((1.0, 0, [], 0.0))
            else:
                bad = np.flatnonzero(bad_np[o:o + T])
                out.append((1.0 - len(bad) / checked, checked, bad[:MAX_NAMED].tolist(),
                            float(ratio_np[o:o + T].max())))
            o += T
        return out
