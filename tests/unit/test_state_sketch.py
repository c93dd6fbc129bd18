"""The state sketch's arithmetic (state_sketch.py): the directions are fixed, the engine's rounding is the
record's, a clean state sits far inside the tolerance and another token's or request's state far outside,
at the hidden sizes of the project's targets and of a 1T model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3_pipeline import state_sketch as sk
from eagle3_pipeline.contracts import dequantise, to_record


def test_directions_are_fixed_unit_vectors():
    a, b = sk.directions(576), sk.directions(576)
    assert a.shape == (576, sk.DIM) and a.dtype == np.float32 and a is b
    assert np.allclose(np.linalg.norm(a, axis=0), 1.0, atol=1e-6)
    g = np.random.Generator(np.random.PCG64(sk.SEED + 576)).standard_normal((sk.DIM, 576))
    assert np.array_equal(a, (g / np.linalg.norm(g, axis=1, keepdims=True)).T.astype(np.float32))
    assert not np.allclose(sk.directions(64)[:64 // 2], sk.directions(576)[:64 // 2])


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_the_engine_rounds_as_the_record_stores(storage):
    x = torch.randn(7, 3, 64, dtype=torch.float32) * torch.tensor([1.0, 30.0, 0.01]).view(1, 3, 1)
    x[0, 1, 5] = 900.0  # an attention-sink-like outlier sets the token's fp8 scale
    got = sk.stored(x, storage)
    want = dequantise(to_record(x, torch.zeros(7, dtype=torch.int64), storage))
    assert torch.equal(got, want)
    assert torch.equal(sk.stored(x.to(torch.bfloat16), "bf16"), x.to(torch.bfloat16).float())


def _states(n: int, L: int, H: int, seed: int = 0) -> torch.Tensor:
    """States with what a real model's share: a large common direction per layer, a few massive dims."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(L, H, generator=g) * 3
    x = common + torch.randn(n, L, H, generator=g)
    x[:, :, :2] *= 40  # massive activations
    return x


@pytest.mark.parametrize("H", [64, 576, 7168])
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_clean_within_and_replaced_far_outside_the_tolerance(H, storage):
    L, n = 4, 64
    x = _states(n, L, H)
    engine = sk.project(sk.stored(x, storage), H)  # what the engine writes
    rec = to_record(x, torch.zeros(n, dtype=torch.int64), storage)
    values = dequantise(rec)  # what verify reads
    # verify's own order of summation: numpy float32 matmul, then float64 as a check of the rounding bound
    mine = torch.from_numpy(values.numpy().reshape(n * L, H) @ sk.directions(H)).view(n, L, sk.DIM)
    norms = values.norm(dim=-1)
    clean = sk.deviation(mine, engine, norms) / sk.TOLERANCE
    assert clean.max() < 0.05, float(clean.max())
    # one aux slot of every token replaced by another token's (another request's) state of the same layer
    y = _states(n, L, H, seed=1)
    for a in range(L - 1):
        v = values.clone()
        v[:, a] = sk.stored(y, storage)[:, a]
        got = sk.project(v, H)
        dev = sk.deviation(got, engine, v.norm(dim=-1)) / sk.TOLERANCE
        assert dev[:, a].min() > 5, (a, float(dev[:, a].min()))  # every replaced token, far outside
        others = [b for b in range(L) if b != a]
        assert dev[:, others].max() < 0.05


def test_missing_and_non_finite_sketches_never_pass():
    norms = torch.ones(2, 3)
    got = torch.zeros(2, 3, sk.DIM)
    exp = torch.zeros(2, 3, sk.DIM)
    exp[0, 1] = float("nan")
    exp[1, 2, 0] = float("inf")
    d = sk.deviation(got, exp, norms)
    assert d[0, 1] == float("inf") and d[1, 2] == float("inf")
    assert d[0, 0] == 0 and d[1, 0] == 0  # an all-zero state projected to zeros


def test_file_name_follows_the_requested_path():
    class SP:
        extra_args = {"kv_transfer_params": {"hidden_states_path": "/x/hs_3.safetensors.tmp-0-engine"}}

    class Req:
        req_id, sampling_params = "r-1", SP()

    assert sk.file_name(Req()) == "hs_3.safetensors.tmp-0-engine"
    Req.sampling_params = None
    assert sk.file_name(Req()) == "r-1.safetensors"


def test_the_hook_fits_the_installed_vllm():
    assert sk.missing() == []
