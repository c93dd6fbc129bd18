"""engine_start: vLLM's start-up refusals (messages as vLLM 0.32 words them) become config errors that
name the key to change; accidents (a crash, a kill) stay transient."""

from __future__ import annotations

import pytest

from eagle3_pipeline.config import EngineConfig, TargetConfig
from eagle3_pipeline.engine.start import EngineStartRefused, kv_bytes_per_token, memory_plan, start_refusal
from eagle3_pipeline.errors import exit_code, is_transient
from eagle3_pipeline.proc import ChildFailed

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
