"""train.compute_dtype: the trainer's autocast dtype. auto = bf16 on cuda and on CPUs that multiply
bf16 in hardware; fp32 on other CPUs, where a bf16 matmul is emulated (measured on an AVX2 core: a tiny
draft's step took 2.8 s in bf16 autocast, ~0.45 s in fp32). The real training in each dtype:
tests/integration/test_train.py (auto, whatever this machine resolves it to, and explicit bf16)."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline.core.config import TrainConfig
from eagle3_pipeline.train import worker


@pytest.mark.parametrize("device, native, want", [
    ("cuda", False, torch.bfloat16), ("cuda", True, torch.bfloat16),
    ("cpu", True, torch.bfloat16), ("cpu", False, torch.float32)])
def test_auto_follows_the_device_and_the_cpu(monkeypatch, device, native, want):
    monkeypatch.setattr(worker, "native_bf16_cpu", lambda: native)
    assert worker.compute_dtype(TrainConfig(device=device)) is want


@pytest.mark.parametrize("name", ["bfloat16", "float32"])
def test_an_explicit_dtype_wins_on_any_cpu(monkeypatch, name):
    for native in (True, False):
        monkeypatch.setattr(worker, "native_bf16_cpu", lambda native=native: native)
        assert worker.compute_dtype(TrainConfig(compute_dtype=name)) is getattr(torch, name)


def test_native_bf16_probe_reads_the_cpu_and_survives_a_failing_probe(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert worker.native_bf16_cpu() is True
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert worker.native_bf16_cpu() is False

    def boom():
        raise RuntimeError("cpuinfo failed")

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", boom, raising=False)
    assert worker.native_bf16_cpu() is False


def test_float16_and_typos_are_refused():
    for bad in ("float16", "bf16", "fp32"):
        with pytest.raises(ValueError, match="compute_dtype"):
            TrainConfig(compute_dtype=bad)


def test_muon_orthogonalises_in_fp32_like_torchs_bf16_iteration(monkeypatch):
    """In fp32 compute, Muon's Newton-Schulz runs in fp32 (torch hard-codes bf16: emulated on AVX2, 38%
    of a tiny draft's step). Same iteration: it agrees with torch's to bf16 precision, on wide and tall
    gradients, and a real Muon step goes through it."""
    import torch.optim._muon as muon

    original = muon._zeropower_via_newtonschulz
    monkeypatch.setattr(muon, "_zeropower_via_newtonschulz", original)  # restored after the test
    coeffs = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
    torch.manual_seed(0)
    grads = [torch.randn(384, 128), torch.randn(64, 300), torch.randn(32, 32)]
    want = [original(g, coeffs, 5, 1e-7).float() for g in grads]
    assert worker.muon_in_fp32() and worker.muon_in_fp32()  # idempotent
    calls = []
    fp32 = muon._zeropower_via_newtonschulz
    monkeypatch.setattr(muon, "_zeropower_via_newtonschulz", lambda *a: calls.append(a[0].shape) or fp32(*a))
    for g, w in zip(grads, want):
        got = fp32(g, coeffs, 5, 1e-7)
        assert got.dtype == torch.float32 and got.shape == g.shape
        assert (got - w).abs().max() < 0.02, (g.shape, (got - w).abs().max())
    with pytest.raises(ValueError):  # a non-matrix: torch's own error
        fp32(torch.randn(3, 4, 5), coeffs, 5, 1e-7)
    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = torch.optim.Muon([p], lr=0.1)
    before = p.detach().clone()
    p.grad = torch.randn(16, 8)
    opt.step()
    assert calls == [torch.Size([16, 8])] and not torch.equal(before, p.detach())
