"""engine_start: vLLM's start-up refusals (messages as vLLM 0.32 words them) become config errors that
name the key to change; accidents (a crash, a kill) stay transient."""

from __future__ import annotations

import pytest

from eagle3_pipeline.core.config import EngineConfig, TargetConfig
from eagle3_pipeline.core.errors import exit_code, is_transient
from eagle3_pipeline.core.proc import ChildFailed
from eagle3_pipeline.engine.start import EngineStartRefused, memory_plan, start_refusal
from eagle3_pipeline.records.families import kv_bytes_per_token

KV = ("ValueError: To serve at least one request with the model's max seq len (513), (0.03 GiB KV cache is needed, "
      "which is larger than the available KV cache memory (0.01 GiB). Based on the available memory, the estimated "
      "maximum model length is 171. Try increasing `gpu_memory_utilization` (which also controls CPU memory on the "
      "CPU backend) or decreasing `max_model_len` when initializing the engine.")
STARTUP = ("ValueError: Available memory on node 0 (9.50/16.34 GiB) on startup is less than desired CPU memory "
           "utilization (0.9, 14.71 GiB). On the CPU backend, the `--gpu-memory-utilization` flag ...")
KV_ALLOC = ("ValueError: Available memory on node 0 (15.20/16.34 GiB) on kv cache allocation is less than requested "
            "memory for kv (-0.48/0.17 GiB). Reduce CPU memory used by other processes.")
MAX_LEN = ("ValueError: User-specified max_model_len (9000) is greater than the derived max_model_len "
           "(max_position_embeddings=8192 or model_max_length=None in model's config.json).")
ARCH = "ValueError: Model architectures ['FancyForCausalLM'] are not supported for now. Supported architectures: ..."


@pytest.mark.parametrize("text, fragments", [
    (KV, ["one sequence of 513 tokens needs 0.03 GiB of KV cache and 0.01 GiB is left",
          "Set extract.gpu_memory_utilization: 0.", "or prepare.max_length below 171"]),
    (STARTUP, ["extract.gpu_memory_utilization 0.2 reserves 14.71 GiB of this machine's 16.34 GiB, but only 9.5 GiB",
               "Set extract.gpu_memory_utilization: 0.55 or less"]),
    (KV_ALLOC, ["already uses 0.65 GiB (weights and runtime)", "Set extract.gpu_memory_utilization: 0."]),
    (MAX_LEN, ["max_model_len 9000 is beyond the model's max_position_embeddings=8192", "Set prepare.max_length"]),
    (ARCH, ["no model class for the architectures ['FancyForCausalLM'] of target.model"]),
])
def test_refusals_name_the_key(text, fragments, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the suite sets it (tests/conftest.py)
    e = start_refusal("INFO some start-up line\n" + text, "extract", EngineConfig(gpu_memory_utilization=0.2),
                      "prepare.max_length")
    assert isinstance(e, EngineStartRefused)
    for f in fragments:
        assert f in str(e), (f, str(e))
    wrapped = RuntimeError("group failed")
    wrapped.__cause__ = e
    assert exit_code(wrapped) == 2 and not is_transient(wrapped, (OSError, ChildFailed))


def test_kv_refusal_value_fits_by_vllm_numbers(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    e = start_refusal(KV, "evaluate", EngineConfig(gpu_memory_utilization=0.2), "evaluate.max_model_len")
    value = float(str(e).split("Set evaluate.gpu_memory_utilization: ")[1].split()[0])
    assert 0.2 < value <= 0.3
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # on CPU it decides the KV cache, not the utilization
    assert "Set VLLM_CPU_KVCACHE_SPACE above 1 GiB" in str(start_refusal(KV, "evaluate", EngineConfig(), "k"))


@pytest.mark.parametrize("text", [
    "Fatal Python error: Segmentation fault", "extract-1 exited with code -9 (SIGKILL)",
    "RuntimeError: Engine core initialization failed. See root cause above.",
])
def test_accidents_are_not_refusals(text):
    assert start_refusal(text, "extract", EngineConfig(), "prepare.max_length") is None


def test_kv_bytes_per_token():
    llama = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_bytes_per_token(llama, 4, 1) == 30 * 2 * 3 * 64 * 4
    mla = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 64}
    assert kv_bytes_per_token(mla, 2, 8) == 61 * 576 * 2  # one latent vector per token, on every rank


def test_memory_plan_of_the_tiny_target(tiny_target):
    plan = memory_plan("extract", EngineConfig(gpu_memory_utilization=0.3), TargetConfig(model=str(tiny_target)),
                       max_model_len=513, captured_layers=4)
    assert plan is not None and plan.fits and plan.min_utilization <= 0.3
    small = memory_plan("extract", EngineConfig(gpu_memory_utilization=0.01), TargetConfig(model=str(tiny_target)),
                        max_model_len=513, captured_layers=4)
    assert small.fits is False


def _kimi_like(tmp_path, weights_gib: int):
    """A model directory with Kimi-K2.5's text dims and a sparse weight file of `weights_gib` (no disk used)."""
    import json as _json

    d = tmp_path / "kimi"
    d.mkdir()
    (d / "config.json").write_text(_json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168,
        "num_attention_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "vocab_size": 163840,
        "torch_dtype": "bfloat16"}))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(weights_gib * 2**30)
    return d


def test_the_wrong_gpus_fail_before_any_load_naming_what_fits(tmp_path, monkeypatch):
    """Kimi-K2.5 INT4 (~595 GiB of weights) at tensor parallel 8: 8 x H100 (80 GiB) cannot hold it, 8 x H200 can.
    Preflight's estimate refuses the H100s naming the GPU types and the tensor parallel size that would fit."""
    from eagle3_pipeline.core.config import ExtractConfig, TargetConfig
    from eagle3_pipeline.engine import start
    from eagle3_pipeline.preflight.stage import hardware_problem

    monkeypatch.setattr(start, "_cpu", lambda: False)
    target = TargetConfig(model=str(_kimi_like(tmp_path, 595)), dtype="bfloat16")
    h100 = ExtractConfig(tensor_parallel_size=8, gpu_memory_utilization=0.9, gpu_memory_gib=80)
    plan = memory_plan("extract", h100, target, max_model_len=4097, captured_layers=4)
    assert plan.device == "gpu" and plan.fits is False
    msg = hardware_problem(plan, h100)
    assert msg.startswith("hardware: extract's engine needs 74 GiB of weights per GPU (tensor_parallel_size 8)"), msg
    assert "8 x H200 (141 GiB)" in msg and "8 x B200 (180 GiB)" in msg and "8 x H100" not in msg, msg
    assert "tensor_parallel_size 16 on these GPUs (more than one node" in msg, msg
    h200 = h100.model_copy(update={"gpu_memory_gib": 141})
    assert memory_plan("extract", h200, target, max_model_len=4097, captured_layers=4).fits is True
    unknown = h100.model_copy(update={"gpu_memory_gib": None})
    monkeypatch.setattr("shutil.which", lambda name: None)  # no nvidia-smi: no device to compare with
    assert memory_plan("extract", unknown, target, max_model_len=4097, captured_layers=4).fits is None
