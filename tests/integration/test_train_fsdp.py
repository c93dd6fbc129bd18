"""FSDP for real on CPU: `train.sharding=fsdp` with two torchrun ranks over gloo, through speculators' own
distributed trainer (its `fsdp_shard`: torch's fully_shard per decoder layer and over the draft, its
DistributedCheckpointer gathering the full state dict for rank 0 to save), against DDP on the same rows.

Both runs see the same packed rows step for step (speculators' multipack sampler, 2 replicas, same seed) from the
same initial draft (rank 0's, broadcast), in fp32 on a CPU without native bf16. What differs is how the
gradients are reduced (DDP: gloo all-reduce of the whole gradient; FSDP: reduce-scatter into shards, then the
optimizer on the shards) and in what order floats are summed, so the losses agree within float noise, amplified
over the steps by Muon's orthogonalisation. The tolerance is the one tests/integration/test_train_nodes.py holds
for the same kind of difference (a gloo sum against a local one): 2% relative, per step; what was measured is in
docs/decisions/fsdp-sharding.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eagle3_pipeline.core.config import TrainConfig
from tests.helpers.training import train_inputs, train_run

pytestmark = pytest.mark.timeout(900)

STEPS = 12


@pytest.fixture(scope="module")
def inputs(tiny_config, tiny_target, prepared, extracted):
    return train_inputs(tiny_config, tiny_target, prepared, extracted)


def _train(inputs, sharding: str, out: Path):
    cfg = TrainConfig(epochs=1, lr=1e-2, max_seq_len=512, draft_layers=1, ttt_steps=3, attention="sdpa", device="cpu",
                      val_ratio=0.15, timeout_s=900, max_steps=STEPS, world_size=2, sharding=sharding,
                      estimate_after_steps=3)
    return train_run(inputs, cfg, out)


@pytest.fixture(scope="module")
def ddp(inputs, tmp_path_factory):
    return _train(inputs, "ddp", tmp_path_factory.mktemp("ddp") / "run")


@pytest.fixture(scope="module")
def fsdp(inputs, tmp_path_factory):
    return _train(inputs, "fsdp", tmp_path_factory.mktemp("fsdp") / "run")


def _load(checkpoint: Path):
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel.from_pretrained(str(checkpoint))


def test_fsdp_trains_on_two_ranks_and_exports_a_draft_that_loads(fsdp, ddp):
    r = fsdp.res
    assert (r.sharding, r.world_size, r.nodes, r.ranks_per_node, r.steps) == ("fsdp", 2, 1, 2, STEPS)
    assert ddp.res.sharding == "ddp"
    assert any("2 ranks on this node (fsdp)" in x for x in fsdp.lines)
    assert r.export_checked  # export_check: the speculators layout, d2t/t2d, copied verifier weights, no NaN
    # speculators' DistributedCheckpointer wrote it (a full state dict gathered from the shards), in the layout
    # DDP's single-rank checkpointer writes: the same files, tensors and shapes
    ckpt = Path(r.checkpoint_best)
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix in (".json", ".safetensors")) == \
        sorted(p.name for p in Path(ddp.res.checkpoint_best).iterdir() if p.suffix in (".json", ".safetensors"))
    a, b = _load(ckpt), _load(Path(ddp.res.checkpoint_best))
    sa, sb = a.state_dict(), b.state_dict()
    assert {k: tuple(v.shape) for k, v in sa.items()} == {k: tuple(v.shape) for k, v in sb.items()}
    assert all(not v.isnan().any() for v in sa.values())
    trained = [k for k in sa if k.startswith("layers.")]
    assert trained and any(not np.allclose(sa[k].float().numpy(), 0) for k in trained)
    # and it was sharded: FSDP's checkpointer saves the optimizer state gathered by parameter name
    # (torch.distributed.checkpoint's full optimizer state dict), DDP's the optimizers' own, by parameter index
    import torch

    opt_f = torch.load(ckpt / "optimizer_state_dict.pt", weights_only=True)
    opt_d = torch.load(Path(ddp.res.checkpoint_best) / "optimizer_state_dict.pt", weights_only=True)
    assert isinstance(opt_f, dict) and any(str(k).startswith("layers.") for k in opt_f["state"]), list(opt_f)[:5]
    assert isinstance(opt_d, list) and all(isinstance(k, int) for o in opt_d for k in o["state"])

    from eagle3_pipeline.report.stage import build_report

    rep = build_report("r", {"name": "t"}, {}, {"train": r.model_dump(mode="json")}, {}, "completed")
    assert rep.stages.train.sharding == "fsdp"


def test_fsdp_follows_ddps_loss_trajectory(fsdp, ddp):
    a, b = ddp, fsdp
    assert len(a.steps) == len(b.steps) == STEPS
    assert [s["tokens"] for s in a.steps] == [s["tokens"] for s in b.steps]  # the same rows, step for step
    la, lb = np.array([s["loss"] for s in a.steps]), np.array([s["loss"] for s in b.steps])
    rel = np.abs(la - lb) / np.abs(la)
    print("ddp :", np.round(la, 4).tolist())
    print("fsdp:", np.round(lb, 4).tolist())
    print(f"relative loss difference per step: {np.round(rel, 6).tolist()}; tok/s ddp {a.res.tokens_per_s:.0f}, "
          f"fsdp {b.res.tokens_per_s:.0f}")
    assert rel.max() < 0.02, (la, lb)
    assert lb[-3:].mean() < 0.8 * lb[:2].mean()  # and it learns
    assert a.val[-1]["loss"] == pytest.approx(b.val[-1]["loss"], rel=0.02)
