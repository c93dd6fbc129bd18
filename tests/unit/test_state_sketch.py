"""The state sketch's arithmetic (state_sketch.py): the directions are fixed, the engine's rounding is the
record's, a clean state sits far inside the tolerance and another token's or request's state far outside,
at the hidden sizes of the project's targets and of a 1T model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3_pipeline.engine import state_sketch as sk
from eagle3_pipeline.records.contracts import dequantise, to_record


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


def test_the_engine_step_keeps_each_request_s_rows_and_writes_when_its_prompt_is_complete(tmp_path, monkeypatch):
    """`_sketch_step` on a runner-shaped object: two requests share a step (their rows at their offsets in the
    step's states), one prompt is computed over two steps (a chunked prefill), the states are rounded and
    projected a few rows at a time; each file is written once its prompt is complete, equal to the
    sketch of that request's own states, named after the file it asked the connector for."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(sk, "CHUNK_BYTES", 3 * 4 * 4 * 32)  # 3 rows of [4, 32] fp32 at a time
    monkeypatch.setattr(sk, "_rank_zero", lambda: True)
    monkeypatch.setenv(sk.STORAGE_ENV, "fp8")
    L, H = 4, 32
    full = {"a": torch.randn(7, L, H), "b": torch.randn(5, L, H)}
    path_of = {"a": "/elsewhere/hs_1.safetensors.tmp-0-engine", "b": None}

    def req(rid):
        extra = {"kv_transfer_params": {"hidden_states_path": path_of[rid]}} if path_of[rid] else None
        return NS(req_id=rid, prompt_token_ids=list(range(len(full[rid]))), num_computed_tokens=0,
                  sampling_params=NS(extra_args=extra))

    runner = NS(requests={"a": req("a"), "b": req("b")}, query_start_loc=NS(np=np.array([0, 4, 9])),
                input_batch=NS(req_id_to_index={"a": 0, "b": 1}))
    # step 1: a's first 4 tokens at rows 0..3, b's 5 tokens at rows 4..8 (then padding)
    step1 = torch.cat([full["a"][:4], full["b"], torch.zeros(2, L, H)])
    sk._sketch_step(runner, NS(num_scheduled_tokens={"a": 4, "b": 5}), list(step1.unbind(1)), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors"]
    runner.requests["a"].num_computed_tokens = 4
    del runner.requests["b"]
    runner.query_start_loc.np, runner.input_batch.req_id_to_index = np.array([0, 3]), {"a": 0}
    sk._sketch_step(runner, NS(num_scheduled_tokens={"a": 3}), list(full["a"][4:].unbind(1)), str(tmp_path))
    for rid, name in (("a", "hs_1.safetensors.tmp-0-engine"), ("b", "b.safetensors")):
        got = sk.read(str(tmp_path / name))
        assert torch.allclose(got, sk.project(sk.stored(full[rid], "fp8"), H), atol=1e-6), rid
    assert runner._eagle3_sketches == {}


def test_the_engine_rounds_as_a_half_precision_kv_cache_does(tmp_path, monkeypatch):
    """A hidden-states cache of another dtype than the model's (cache_dtype float16) rounds the states before the
    connector sees them: the sketch is of those values."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(sk, "_rank_zero", lambda: True)
    monkeypatch.setenv(sk.STORAGE_ENV, "bf16")
    x = torch.randn(6, 3, 16, dtype=torch.float32)
    req = NS(req_id="r", prompt_token_ids=list(range(6)), num_computed_tokens=0, sampling_params=None)
    runner = NS(requests={"r": req}, query_start_loc=NS(np=np.array([0, 6])), input_batch=NS(req_id_to_index={"r": 0}),
                cache_config=NS(cache_dtype="float16"))
    sk._sketch_step(runner, NS(num_scheduled_tokens={"r": 6}), list(x.unbind(1)), str(tmp_path))
    got = sk.read(str(tmp_path / "r.safetensors"))
    assert torch.equal(got, sk.project(sk.stored(x.half(), "bf16"), 16))


def test_both_adapters_fit_the_installed_vllm():
    """The CPU build carries V2's classes too (0.34's have the same parameters: tests/unit/test_vllm_surface.py)."""
    assert sk.missing("v1") == [] and sk.missing("v2") == []


def test_the_v2_adapter_sketches_the_states_the_speculator_is_given(tmp_path, monkeypatch):
    """The V2 adapter on vLLM's own V2 classes, their methods stubbed (no V2 engine runs on a CPU here):
    add_requests names each request's file and prompt length, propose hands over the step's rows by its
    InputBatch (batch order, one prompt over two steps); each file equals the sketch of that request's own states
    (what the V1 hook writes), and the dummy runs of start-up are not sketched."""
    import functools
    from types import SimpleNamespace as NS

    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import ExtractHiddenStatesSpeculator

    from eagle3_pipeline.engine import runner

    calls = []

    @functools.wraps(ExtractHiddenStatesSpeculator.propose)
    def propose(self, *args, **kwargs):
        calls.append("propose")
        return "drafts"

    @functools.wraps(GPUModelRunner.add_requests)
    def add_requests(self, scheduler_output):
        calls.append("add")

    monkeypatch.setattr(ExtractHiddenStatesSpeculator, "propose", propose)
    monkeypatch.setattr(GPUModelRunner, "add_requests", add_requests)
    monkeypatch.setattr(runner, "expected", lambda: "v2")
    monkeypatch.setitem(sk._STATE, "installed", False)
    monkeypatch.setattr(sk, "_NEW", {})
    monkeypatch.setattr(sk, "_rank_zero", lambda: True)
    monkeypatch.setenv(sk.ENV, str(tmp_path))
    monkeypatch.setenv(sk.STORAGE_ENV, "bf16")
    assert sk.install()
    L, H = 3, 32
    full = {"a": torch.randn(7, L, H), "b": torch.randn(5, L, H)}
    kv = {"kv_transfer_params": {"hidden_states_path": "/elsewhere/hs_1.safetensors.tmp-0-engine"}}
    new = [NS(req_id="a", prompt_token_ids=list(range(7)), sampling_params=NS(extra_args=kv)),
           NS(req_id="b", prompt_token_ids=list(range(5)), sampling_params=None)]
    GPUModelRunner.add_requests(object(), NS(scheduled_new_reqs=new))
    spec = NS(vllm_config=NS(cache_config=NS(cache_dtype="auto")))

    def step(req_ids, n, computed, aux, **kwargs):
        qsl = np.concatenate([[0], np.cumsum(n)])
        batch = NS(req_ids=req_ids, num_scheduled_tokens=np.array(n, dtype=np.int32),
                   num_computed_tokens_np=np.array(computed, dtype=np.int32), query_start_loc_np=qsl)
        # as the V2 runner calls it: positional up to the seeds, then keywords
        return ExtractHiddenStatesSpeculator.propose(spec, batch, {}, {}, None, list(aux.unbind(1)), None, None, None,
                                                     None, None, None, **kwargs)

    assert step(["x"], [4], [0], torch.randn(4, L, H), dummy_run=True) == "drafts"  # a start-up dummy: not sketched
    step(["a", "b"], [4, 5], [0, 0], torch.cat([full["a"][:4], full["b"], torch.zeros(2, L, H)]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors"]
    step(["a"], [3], [4], full["a"][4:])
    for rid, name in (("a", "hs_1.safetensors.tmp-0-engine"), ("b", "b.safetensors")):
        got = sk.read(str(tmp_path / name))
        assert torch.allclose(got, sk.project(sk.stored(full[rid], "bf16"), H), atol=1e-6), rid
    assert calls == ["add", "propose", "propose", "propose"] and sk._NEW == {} and spec._eagle3_sketches == {}
