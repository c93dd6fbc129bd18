"""The training loop both embedded targets share (tiny/target.py, tiny/moe_target.py): AdamW, 30-step
warm-up, cosine decay to 10% of the learning rate, seeded batch draws, gradient clipping at 1.0, a
deterministic step budget (`cfg.max_steps`) and no time cap: a loaded machine takes longer but builds
the same target (a time cap once cut a CI build short and every calibrated test downstream saw another
model). `after_step` runs after each optimizer step (the MoE's router-bias balancing)."""

from __future__ import annotations

import math
import time


def train_lm(model, data, targets, cfg, log, label: str, after_step=None) -> tuple[list[dict], int, float]:
    """Train `model` on `data` [rows, seq] with `targets`; returns (loss curve, steps, start time)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(cfg.seed)
    curve, step, t_train = [], 0, time.time()
    model.train()
    while step < cfg.max_steps:
        warm = min(1.0, (step + 1) / 30)
        frac = step / cfg.max_steps  # cosine decay to 10% of lr
        for grp in opt.param_groups:
            grp["lr"] = cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        pick = torch.randint(0, data.shape[0], (cfg.batch_size,), generator=g)
        loss = model(input_ids=data[pick], labels=targets[pick]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        if step % 50 == 0:
            curve.append({"step": step, "loss": round(loss.item(), 4)})
            log(f"{label}: step {step} loss {loss.item():.3f}")
        step += 1
    return curve, step, t_train
