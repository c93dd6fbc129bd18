import sys
import types

import pytest

from eagle3_pipeline.core.config import EngineConfig, EvaluateConfig, ExtractConfig, TargetConfig
from eagle3_pipeline.engine.build import (
    CPU_COMPILATION_CONFIG,
    build_llm,
    cpu_bind_spec,
    cpu_build_kwargs,
    cpu_executor_kwargs,
    cpu_mla_kwargs,
    eagle3_config,
    engine_env,
    extract_hidden_states_config,
    hidden_states_kv_config,
)


def test_cpu_bind_spec_splits_cores_per_tp_rank():
    assert cpu_bind_spec("all", 1, [1, 0]) == "0,1"
    assert cpu_bind_spec("all", 2, [0, 1, 2, 3]) == "0,1|2,3"
    assert cpu_bind_spec("all", 2, [0]) == "0|0"  # more ranks than cores: ranks share the last core
    assert cpu_bind_spec("0-3", 1, [0, 1]) == "0-3"


def test_engine_env_in_process_needs_passive_openmp(monkeypatch):
    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(k, raising=False)
    env = engine_env(EngineConfig(engine_in_process=None, tensor_parallel_size=1, omp_threads_bind="all"))
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "VLLM_CPU_OMP_THREADS_BIND" in env
    separate = engine_env(EngineConfig(engine_in_process=False, omp_threads_bind=None))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in separate and "OMP_WAIT_POLICY" not in separate
    tp2 = EngineConfig(tensor_parallel_size=2, omp_threads_bind=None)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env(tp2)  # TP>1: vLLM's own processes
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    in_process = EngineConfig(engine_in_process=True, omp_threads_bind=None)
    assert engine_env(in_process)["OMP_WAIT_POLICY"] == "ACTIVE"  # the caller's environment wins
    # a stage's config is its engine config: the same environment
    assert engine_env(ExtractConfig(engine_in_process=True, omp_threads_bind=None)) == engine_env(in_process)
    # eager engines do not compile vLLM's sampler ops either (2.7 s of inductor per engine); the caller's value wins
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert engine_env(in_process)["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in engine_env(in_process.model_copy(update={"enforce_eager": False}))


def test_stage_configs_carry_the_engine_keys():
    for cfg in (ExtractConfig(), EvaluateConfig()):
        assert set(EngineConfig.model_fields) <= set(cfg.model_dump())
    e = ExtractConfig(tensor_parallel_size=2, gpu_memory_utilization=0.5, enforce_eager=False, max_num_seqs=3)
    assert type(e.engine()) is EngineConfig
    assert e.engine().model_dump() == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
                                       "enforce_eager": False, "omp_threads_bind": "all", "engine_in_process": None,
                                       "gpu_memory_gib": None}


@pytest.fixture
def llm_kwargs(monkeypatch):
    """`vllm.LLM` replaced by a recorder: build_llm returns the keyword arguments it passed (and does not
    touch vLLM's attention backends)."""
    fake, saved = types.SimpleNamespace(LLM=lambda **kw: kw), sys.modules.get("vllm")
    sys.modules["vllm"] = fake
    monkeypatch.setattr("eagle3_pipeline.engine.build.cpu_attention_accepts_block_16", lambda: False)
    monkeypatch.setattr("eagle3_pipeline.engine.build._proven", lambda make: make())  # no workers to record a runner
    yield
    # Not monkeypatch.setitem: a test that went on to import the real vLLM (sys.modules.pop("vllm")) loaded
    # vllm.* submodules as attributes of that package; dropping it left them orphaned, and the next module's
    # `import vllm` made a package without them (AttributeError: module vllm has no attribute config).
    # vLLM cannot be imported twice in a process either (torch opaque types register once).
    now = sys.modules.get("vllm")
    if isinstance(saved, types.ModuleType):
        sys.modules["vllm"] = saved
    elif not isinstance(now, types.ModuleType):
        sys.modules.pop("vllm", None)


TARGET = TargetConfig(model="/m", revision="r1", trust_remote_code=False)


def test_build_llm_for_extract_passes_what_the_extract_worker_always_did(llm_kwargs):
    engine = ExtractConfig(tensor_parallel_size=2, gpu_memory_utilization=0.4).engine()
    kw = build_llm(engine, TARGET, max_model_len=99, speculative_config=extract_hidden_states_config([2, 4, 5, 8]),
                   kv_transfer_config=hidden_states_kv_config("mod.path", "Conn", "/scratch"),
                   max_num_seqs=64, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert kw == dict(
        model="/m", tokenizer="/m", revision="r1", dtype="bfloat16", trust_remote_code=False,
        tensor_parallel_size=2, gpu_memory_utilization=0.4, max_num_seqs=64, max_model_len=99, enforce_eager=True,
        enable_chunked_prefill=False, enable_prefix_caching=False, seed=0,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]}}},
        kv_transfer_config={"kv_connector": "Conn", "kv_connector_module_path": "mod.path", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": "/scratch"}}, **cpu_build_kwargs(),
        **cpu_executor_kwargs(engine))  # {}: two ranks


def test_build_llm_for_evaluate_passes_what_the_evaluate_worker_always_did(llm_kwargs):
    engine = EvaluateConfig().engine()
    common = dict(model="/m", tokenizer="/m", revision="r1", dtype="bfloat16", trust_remote_code=False,
                  tensor_parallel_size=1, gpu_memory_utilization=0.3, max_model_len=77, enforce_eager=True,
                  seed=0, disable_log_stats=False, **cpu_build_kwargs(), **cpu_executor_kwargs(engine))
    draft = build_llm(engine, TARGET, max_model_len=77, speculative_config=eagle3_config("/d", 3),
                      disable_log_stats=False)
    assert draft == {**common, "speculative_config": {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}}
    plain = build_llm(engine, TARGET, max_model_len=77, disable_log_stats=False)
    assert plain == {**common, "speculative_config": None}  # no kv_transfer_config at all


def test_cpu_engines_use_vllms_pytorch_rotary_the_cpu_kernel_mis_rotates_mla_queries(llm_kwargs):
    """vllm-cpu 0.32's rotary kernel rotates a 3-D query [T, heads, rot] (MLA's rope slice of q) as if it
    were [T * heads] tokens of one head; vLLM's PyTorch rotary (`forward_native`, what
    CPU_COMPILATION_CONFIG selects) matches transformers' interleaved DeepSeek rope. If the kernel is
    ever fixed, this test says so and the workaround can go."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    from eagle3_pipeline.engine.build import vllm_is_cpu_build

    if not vllm_is_cpu_build():
        pytest.skip("the CPU build's kernel")
    assert cpu_build_kwargs() == {"compilation_config": CPU_COMPILATION_CONFIG}
    kw = build_llm(EngineConfig(), TARGET, max_model_len=8)
    assert kw["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert build_llm(EngineConfig(), TARGET, max_model_len=8, compilation_config={"x": 1})["compilation_config"] == {"x": 1}

    sys.modules.pop("vllm")  # the real vLLM from here on
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    torch.manual_seed(0)
    T, heads, rot, nope = 12, 4, 64, 32
    pos = torch.arange(T)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(rot, max_position=64, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    q = torch.randn(T, heads, nope + rot)
    kv = torch.randn(T, 512 + rot)  # MLA's latent: the rope key is a strided slice of it
    native_q, native_k = rope.forward_native(pos, q[..., nope:].clone(), kv[:, 512:].unsqueeze(1).clone())
    # transformers' DeepSeek-V3 rope (rope_interleave); its output is de-interleaved, so compare q.k scores
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, -1)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q[..., nope:].transpose(0, 1)[None], kv[:, 512:][None, None],
                                                 emb.cos()[None], emb.sin()[None])
    scores = lambda a, b: torch.einsum("hqd,kd->hqk", a, b)  # noqa: E731
    assert torch.allclose(scores(native_q.transpose(0, 1), native_k[:, 0]), scores(hf_q[0], hf_k[0, 0]), atol=1e-3)
    kernel_q, _ = rope.forward_cpu(pos, q[..., nope:].clone(), kv[:, 512:].unsqueeze(1).clone())
    wrong = (kernel_q - native_q).abs().amax().item()  # at position 0 both leave q as it is
    assert (kernel_q[0, 0] - native_q[0, 0]).abs().max() < 1e-5
    assert wrong > 1.0, f"the CPU rotary kernel now rotates 3-D queries right (max error {wrong}): drop the workaround"


def test_cpu_attention_declares_its_16_token_path_so_an_eagle3_draft_fits_an_mla_target(monkeypatch):
    """Without AMX, vllm-cpu forces an MLA target's KV blocks to 16 tokens (CPU_MLA) while CPU_ATTN, the
    draft's attention, declares multiples of 32 only: no common block size, the engine never started.
    Its kernel takes the 16-token 'vec16' path for such blocks; once declared, 16 is the common size. If
    vLLM ever declares 16 itself, this test says so and the workaround can go."""
    import torch

    from eagle3_pipeline.engine.build import cpu_attention_accepts_block_16, vllm_is_cpu_build

    if not vllm_is_cpu_build():
        pytest.skip("the CPU build's attention backends")
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.worker.utils import select_common_block_size

    backend = cpu_attn.CPUAttentionBackend
    monkeypatch.setattr(backend, "get_supported_kernel_block_sizes", backend.get_supported_kernel_block_sizes)
    assert 16 not in backend.get_supported_kernel_block_sizes(), "vLLM declares 16 itself now: drop the workaround"
    with pytest.raises(ValueError, match="No common block size for 16"):
        select_common_block_size(16, [CPUMLABackend, backend])
    assert cpu_attn._get_attn_isa(torch.bfloat16, 16, head_size=64) == "vec16"  # the kernel's 16-token path
    assert cpu_attention_accepts_block_16() is True
    assert cpu_attention_accepts_block_16() is False  # idempotent
    assert select_common_block_size(16, [CPUMLABackend, backend]) == 16
    assert select_common_block_size(128, [backend]) == 128  # dense targets keep their blocks


def test_engine_settings_that_change_records_are_in_their_keys(monkeypatch, tmp_path):
    """Records extracted with vllm-cpu's rotary kernel (wrong for MLA) must not be reused by an engine
    with vLLM's PyTorch rotary: the CPU build's engine settings are part of the extract and pool keys;
    GPU builds (no such settings) keep the keys they had."""
    import eagle3_pipeline.engine.build as engine
    from eagle3_pipeline.core.store import extract_key, model_fingerprint
    from eagle3_pipeline.records.layout import extract_location
    from eagle3_pipeline.records.pool import pool_key

    target = TargetConfig(model=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    keys = {}
    for cpu in (True, False):
        monkeypatch.setattr(engine, "vllm_is_cpu_build", lambda cpu=cpu: cpu)
        keys[cpu] = (extract_location(types.SimpleNamespace(dir=tmp_path, version="p1"), target, [2, 4], "bf16", "m.C",
                                      engine.cpu_build_kwargs())[0],
                     pool_key(target, [2, 4], "bf16", "m.C", 1, engine.cpu_build_kwargs()))
    assert keys[True][0] != keys[False][0] and keys[True][1] != keys[False][1]
    fp = model_fingerprint(str(tmp_path), None)
    assert keys[False][0] == extract_key("p1", fp, [2, 4], "bf16", "m.C")
    assert keys[True][0] == extract_key("p1", fp, [2, 4], "bf16", "m.C", {"compilation_config": CPU_COMPILATION_CONFIG})


def test_an_impossible_weight_load_time_is_rewritten_a_real_one_is_kept(caplog):
    """vLLM's loader times from 0.0 when no weight came from files (the capture model of
    extract_hidden_states): its log said "Loading weights took 53060.77 seconds" (the clock since boot)."""
    import logging

    from eagle3_pipeline.engine.build import guard_load_time_log, process_age

    guard_load_time_log()
    guard_load_time_log()  # once, however often engines are built
    log = logging.getLogger("vllm.model_executor.model_loader.default_loader")
    assert sum(type(f).__name__ == "_ImpossibleLoadTime" for f in log.filters) == 1
    with caplog.at_level(logging.INFO, logger=log.name):
        log.info("Loading weights took %.2f seconds", 0.02)
        log.info("Loading weights took %.2f seconds", process_age() + 53060.77)
    real, impossible = [r.getMessage() for r in caplog.records]
    assert real == "Loading weights took 0.02 seconds"
    assert "none read from files" in impossible and "took" not in impossible, impossible


def test_an_mla_target_in_float32_gets_vllms_reference_mla_backend(llm_kwargs, tmp_path):
    """vLLM prefers its AMX MLA backend wherever the CPU has AMX, and that backend refuses float32
    weights at load (CI met it on an AMX machine with the random DeepSeek-V3 target in float32):
    an MLA target in float32 is given CPU_MLA, in process and in a server's command line; bf16, a
    model without MLA and a hub name are left to vLLM."""
    import json

    from eagle3_pipeline.engine.build import server_argv, vllm_is_cpu_build

    if not vllm_is_cpu_build():
        pytest.skip("the CPU build's MLA backends")
    mla, dense = tmp_path / "mla", tmp_path / "dense"
    dims = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 99}
    for d, text in ((mla, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}), (dense, {"head_dim": 64})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "x", **dims, **text}))
    f32 = TargetConfig(model=str(mla), dtype="float32")
    assert cpu_mla_kwargs(f32) == {"attention_backend": "CPU_MLA"}
    assert build_llm(EngineConfig(), f32, max_model_len=8)["attention_backend"] == "CPU_MLA"
    argv = server_argv(EngineConfig(), f32, max_model_len=8, port=1)
    assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA"
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {**dims, "kv_lora_rank": 512}}))
    assert cpu_mla_kwargs(TargetConfig(model=str(nested), dtype="float32")) == {"attention_backend": "CPU_MLA"}
    for other in (TargetConfig(model=str(mla), dtype="bfloat16"), TargetConfig(model=str(dense), dtype="float32"),
                  TargetConfig(model="org/hub-name", dtype="float32")):
        assert cpu_mla_kwargs(other) == {} and "attention_backend" not in build_llm(EngineConfig(), other, max_model_len=8)
    # vLLM's own parser reads that command line: tests/unit/test_online_parts.py
