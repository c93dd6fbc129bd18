"""Training past one node, for real on CPU: two torchrun agents on 127.0.0.1 (`train.nodes=2`, one gloo rank each)
meeting through c10d, against one node with the same global batch in tokens (two accumulation steps). Both train
on the same packed rows step for step (train/accumulate.py), so the steps match exactly and the losses within
float noise (gloo's all-reduce against a local sum); the record and report.json state the topology."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eagle3_pipeline.core.config import TrainConfig
from tests.helpers.training import train_inputs, train_run

pytestmark = pytest.mark.timeout(900)

GLOBAL_BATCH = 1024  # tokens per optimizer step: 2 packed rows of 512


@pytest.fixture(scope="module")
def inputs(tiny_config, tiny_target, prepared, extracted):
    return train_inputs(tiny_config, tiny_target, prepared, extracted)


def _cfg(**kw) -> TrainConfig:
    base = dict(epochs=1, lr=1e-2, max_seq_len=512, draft_layers=1, ttt_steps=3, attention="sdpa", device="cpu",
                val_ratio=0.15, timeout_s=900, max_steps=12, global_batch_tokens=GLOBAL_BATCH, estimate_after_steps=3)
    return TrainConfig(**{**base, **kw})


def _train(inputs, cfg: TrainConfig, out: Path):
    return train_run(inputs, cfg, out)


@pytest.fixture(scope="module")
def one_node(inputs, tmp_path_factory):
    return _train(inputs, _cfg(), tmp_path_factory.mktemp("one-node") / "run")


@pytest.fixture(scope="module")
def two_nodes(inputs, tmp_path_factory):
    return _train(inputs, _cfg(nodes=2, world_size=1), tmp_path_factory.mktemp("two-nodes") / "run")


def test_two_nodes_train_through_c10d_and_say_so(two_nodes, one_node):
    r = two_nodes.res
    assert (r.nodes, r.ranks_per_node, r.world_size, r.accumulation_steps, r.global_batch_tokens) == (2, 1, 2, 1, GLOBAL_BATCH)
    o = one_node.res
    assert (o.nodes, o.ranks_per_node, o.world_size, o.accumulation_steps, o.global_batch_tokens) == (1, 1, 1, 2, GLOBAL_BATCH)
    assert any("2 nodes x 1 ranks" in x and "rendezvous 127.0.0.1:" in x for x in two_nodes.lines)
    assert r.fit is not None and r.fit["fits"] and r.fit["tokens_per_s"] > 0
    assert any("the stage's deadline" in x and "it fits" in x for x in two_nodes.lines)

    from eagle3_pipeline.report.stage import build_report

    rep = build_report("r", {"name": "t"}, {}, {"train": r.model_dump(mode="json")}, {}, "completed")
    train = rep.stages.train
    assert (train.nodes, train.ranks_per_node, train.accumulation_steps, train.global_batch_tokens) == \
        (2, 1, 1, GLOBAL_BATCH)
    assert train.details["fit"]["fits"] and train.details["resumed_from_step"] == 0


def test_the_loss_does_not_depend_on_the_topology(two_nodes, one_node):
    """Same global batch, same rows per step: same steps, same tokens, the same losses within float noise."""
    a, b = one_node, two_nodes
    assert a.res.steps == b.res.steps == 12 and len(a.steps) == len(b.steps) == 12
    assert [s["tokens"] for s in a.steps] == pytest.approx([s["tokens"] for s in b.steps], rel=0.25)
    la, lb = np.array([s["loss"] for s in a.steps]), np.array([s["loss"] for s in b.steps])
    print("one node :", np.round(la, 4).tolist())
    print("two nodes:", np.round(lb, 4).tolist())
    rel = np.max(np.abs(la - lb) / np.abs(la))
    print(f"largest relative loss difference {rel:.2e}; tok/s one node {a.res.tokens_per_s:.0f}, two nodes "
          f"{b.res.tokens_per_s:.0f}")
    assert rel < 0.02, (la, lb)
    assert lb[-3:].mean() < 0.8 * lb[:2].mean()  # and it learns
    assert a.val[-1]["loss"] == pytest.approx(b.val[-1]["loss"], rel=0.05)
