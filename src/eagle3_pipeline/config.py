"""Pipeline configuration: one pydantic group per stage, `extra="forbid"` everywhere.

Owns `PipelineConfig` and `load_config(path, overrides)`. Reads one YAML file per target model
(configs/*.yaml); `overrides` are `dotted.key=value` strings parsed as YAML scalars, applied before
validation, so a typo in a key fails loudly. Paths in the YAML are relative to the current directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetConfig(Strict):
    model: str = Field(description="HF model directory (or hub name on machines that can reach a hub)")
    tokenizer: str | None = Field(None, description="defaults to the model directory")
    revision: str | None = None
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _default_tokenizer(self):
        if self.tokenizer is None:
            self.tokenizer = self.model
        return self


class SourceConfig(Strict):
    path: str = Field(description="file, directory, save_to_disk dir, or a hub dataset name (org/name)")
    format: Literal["auto", "sharegpt", "openai", "pretokenized"] = "auto"
    limit: int | None = Field(None, description="use at most this many rows of the source")
    split: str = "train"
    revision: str | None = None


class PrepareConfig(Strict):
    dataset: str = Field("default", description="dataset name: the first level of the run store")
    sources: list[SourceConfig]
    max_length: int = 512
    min_supervised_tokens: int = 1
    rows_per: Literal["conversation", "turn"] = "conversation"
    heldout_rows: int = Field(16, description="conversations kept out of training for evaluate")
    num_proc: int = Field(1, description="processes that tokenize chunks in parallel")
    chunk_rows: int = Field(1000, description="input rows per content-keyed chunk (a refresh redoes only changed chunks)")


class ExtractConfig(Strict):
    layer_ids: list[int] | None = Field(None, description="aux layer ids; default [2, N//2, N-3]; N is appended")
    rows_per_shard: int = 64
    shards_per_group: int | None = Field(None, description="shards one engine child runs (one model load); "
                                                             "None = all remaining shards in one group")
    parallel_groups: int = Field(1, description=">1: groups fan out to the extract-group deployment (GPU pool)")
    tensor_parallel_size: int = 1
    storage_dtype: Literal["bf16", "fp8"] = "bf16"
    gpu_memory_utilization: float = 0.3
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = True
    timeout_s: float = 3600.0
    retries: int = 2
    omp_threads_bind: str | None = Field("all", description="CPU only: VLLM_CPU_OMP_THREADS_BIND; 'all' = every core")
    scratch_dir: str | None = Field(None, description="fast local dir for vLLM's per-request files; "
                                    "default <extract version dir>/.scratch")
    engine_in_process: bool | None = Field(None, description="vLLM engine core inside the extract child "
                                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0); None = on CPU with TP 1")
    connector_module: str = Field("eagle3_pipeline.extract.connector",
                                  description="module of the vLLM KV connector that writes hidden states")
    connector_name: str = Field("Eagle3HiddenStatesConnector", description="class name of that connector")


class VerifyConfig(Strict):
    reference_samples: int = Field(4, description="rows re-computed with HF transformers (0 = skip, noted)")
    move_bad_files: bool = Field(True, description="move failing files to hidden_states_failed/ (never deleted)")
    norm_bounds_samples: int = Field(64, ge=0, description="per-layer mean-token-norm bounds are learned from the "
                                     "first N good files (median/MAD in log space); 0 = no norm check")
    norm_bounds_factor: float = Field(10.0, gt=0, description="bounds = median x/÷ exp(factor * 1.4826 * MAD) "
                                      "of the log mean token norms")
    norm_bounds_min_ratio: float = Field(1.5, ge=1.0, description="the bounds are never tighter than "
                                         "median x/÷ this ratio")
    invariance_samples: int = Field(4, ge=0, description="rows re-extracted alone (batch of one, one engine "
                                    "child) and compared with the stored batched files (0 = skip, noted)")
    invariance_max_rel_err: float = Field(0.02, gt=0, description="per layer, relative L2 error allowed between "
                                          "batched and alone (bf16; fp8 storage uses 4x)")
    invariance_min_cosine: float = Field(0.999, description="per token, cosine allowed between batched and "
                                         "alone (bf16; fp8 storage: 1 - 4 x (1 - this))")
    workers: int | None = Field(None, ge=1, description="threads reading and checking files; None = CPU count (max 8)")


class VocabConfig(Strict):
    draft_vocab_size: int = 512


class TrainConfig(Strict):
    epochs: int = 3
    lr: float = 1e-3
    max_seq_len: int = Field(1024, description="tokens per packed training row (speculators total_seq_len)")
    draft_layers: int = 1
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    attention: Literal["sdpa", "eager", "flex_attention"] = "sdpa"
    device: Literal["cpu", "cuda"] = "cpu"
    seed: int = 0
    optimizer: Literal["adamw", "muon"] = "muon"
    loss: str = Field("kl_div", description="speculators loss spec: a name (kl_div, ce, tv, ...) or a JSON dict of weights")
    val_ratio: float = Field(0.1, gt=0.0, lt=1.0, description="last fraction of the rows held out for validation / checkpoint_best")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (smoke runs)")
    num_workers: int = Field(0, ge=0, description="data-loader worker processes (0 on CPU)")
    num_gpus: int = Field(1, ge=1, description="cuda only: >1 launches the worker with torchrun (DDP)")
    fsdp: bool = Field(False, description="cuda with num_gpus > 1: shard parameters with FSDP (speculators' "
                       "--fsdp-shard) instead of replicating them (DDP); for drafts too large for one GPU")
    gradient_checkpointing: bool = Field(False, description="recompute draft-layer activations in backward "
                                         "(less memory for long rows, ~30-50% slower backward)")
    log_freq: int = Field(1, ge=1, description="log metrics every N optimizer steps; each logged step synchronizes "
                          "the accelerator, so use ~10+ on GPUs")
    timeout_s: float = 24 * 3600.0

    @model_validator(mode="after")
    def _device(self):
        if self.device == "cpu" and self.attention == "flex_attention":
            raise ValueError("train.attention=flex_attention needs train.device=cuda (flex attention has no CPU backward); "
                             "use sdpa or eager on CPU")
        if self.device == "cpu" and self.num_gpus != 1:
            raise ValueError(f"train.num_gpus={self.num_gpus} needs train.device=cuda")
        if self.fsdp and (self.device != "cuda" or self.num_gpus < 2):
            raise ValueError(f"train.fsdp=true needs train.device=cuda and train.num_gpus >= 2 (torchrun); found "
                             f"device={self.device}, num_gpus={self.num_gpus}")
        return self


class EvaluateConfig(Strict):
    num_prompts: int = 16
    num_speculative_tokens: int = 3
    max_tokens: int = 64
    min_acceptance_length: float = 1.0
    baseline: bool = True
    check_lossless: bool = Field(True, description="also decode greedily without speculation and compare tokens "
                                 "(one more target load in the same child)")
    lossless_gate: bool = Field(False, description="fail the gate on a lossless mismatch (bf16 near-ties can flip "
                                "an argmax between batched verification and one-token decoding)")
    sample_texts: int = Field(4, description="generated texts of the first N prompts kept in the record")
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = Field(None, description="default: longest prompt + max_tokens + drafts")
    enforce_eager: bool = True
    omp_threads_bind: str | None = Field("all", description="CPU only: VLLM_CPU_OMP_THREADS_BIND; 'all' = every core")
    timeout_s: float = Field(3600.0, description="deadline of the evaluate child (all its engine loads together)")
    engine_in_process: bool | None = Field(None, description="vLLM engine core inside the evaluate child "
                                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0, passive OpenMP waits); "
                                           "None = on a CPU build of vLLM with TP 1")


class PipelineConfig(Strict):
    name: str
    store: str = "runs/store"
    target: TargetConfig
    prepare: PrepareConfig
    extract: ExtractConfig = ExtractConfig()
    verify: VerifyConfig = VerifyConfig()
    vocab: VocabConfig = VocabConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()


def _set_dotted(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a mapping")
    d[parts[-1]] = value


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Load a YAML config and apply `key.sub=value` overrides (values parsed as YAML)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} is not of the form key=value")
        k, v = ov.split("=", 1)
        _set_dotted(data, k.strip(), yaml.safe_load(v))
    return PipelineConfig.model_validate(data)
