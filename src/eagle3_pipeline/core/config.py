"""Pipeline configuration: one pydantic group per stage, `extra="forbid"` everywhere.

More: docs/internals.md, "core/config.py".
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3_pipeline.core.errors import ConfigError

PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetConfig(Strict):
    model: str = Field(description="HF model directory (a hub name only with `hub: true`)")
    tokenizer: str | None = Field(None, description="defaults to the model directory")
    hub: bool = Field(False, description="model and tokenizer may be hub ids (org/name) that transformers and vLLM "
                      "download; off, each must be a local directory, checked before any stage runs")
    revision: str | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="the dtype vLLM (extract, regenerate, evaluate) and the streamed verify reference "
        "run the target in; float32 for a small target on a CPU without native bf16, where vLLM emulates bf16 matmuls")
    trust_remote_code: bool = Field(False, description="run Python code shipped with the model/tokenizer; "
                                    "only for a model you trust")
    hub_token_env: str = Field("HF_TOKEN", description="environment variable holding a hub token (never "
                               "written to the config, the store or the logs)")
    hub_token_secret: str | None = Field(None, description="name of a Prefect Secret block with the hub token; "
                                         "the flows put its value into `hub_token_env` of their process")

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
    on_damaged: Literal["error", "keep_complete"] = Field(
        "error", description="a JSON file cut or corrupt part-way: stop with the byte offset (error), or keep the "
        "complete records before the damage and record the loss in prepare.json (keep_complete)")


class PrepareConfig(Strict):
    dataset: str = Field("default", description="dataset name: the first level of the run store "
                         "(a plain directory name: letters, digits, '.', '_', '-')")
    sources: list[SourceConfig]
    max_length: int = 512
    min_supervised_tokens: int = 1
    rows_per: Literal["conversation", "turn"] = "conversation"
    heldout_rows: int = Field(16, description="conversations kept out of training for evaluate")
    heldout_fraction: float | None = Field(None, ge=0.0, lt=1.0, description="hold out every conversation whose "
                                           "sha256(id) falls below this fraction: a function of the conversation "
                                           "alone, so a refresh that adds rows never moves one between training "
                                           "and held-out (heldout_rows then only caps heldout.jsonl); None = the "
                                           "heldout_rows lowest hashes (a refresh may shift that set)")
    warn_loss_share: float = Field(0.02, ge=0, le=1, description="a run that quarantines or trims more than this "
                                   "share of its input rows ends 'completed with warnings', the numbers first in the report")
    warn_reason_share: float = Field(0.01, ge=0, le=1, description="the same for any single quarantine or trim reason")
    num_proc: int = Field(1, description="processes that tokenize chunks in parallel")
    chunk_rows: int = Field(1000, description="input rows per content-keyed chunk (a refresh redoes only changed chunks)")

    @field_validator("dataset")
    @classmethod
    def _plain_dataset_name(cls, v: str) -> str:
        if not PLAIN_NAME.fullmatch(v) or v in (".", ".."):
            raise ValueError(f"{v!r} is not a plain directory name (letters, digits, '.', '_', '-'; no '/', "
                             f"no '..', not absolute): it names a directory directly under the store root")
        return v


class EngineConfig(Strict):
    """The vLLM engine settings every stage that starts an engine has (engine.build_llm, engine.engine_env).
    Not a YAML section of its own: ExtractConfig and EvaluateConfig inherit these keys."""
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = True
    omp_threads_bind: str | None = Field("all", description="CPU only: VLLM_CPU_OMP_THREADS_BIND; 'all' = every core")
    engine_in_process: bool | None = Field(None, description="vLLM engine core inside the engine child "
                                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0); None = on CPU with TP 1")
    gpu_memory_gib: float | None = Field(None, gt=0, description="memory of one GPU the stage's engine runs on (the "
                                         "GPU type its node or Job has: H100 80, H200 141, B200 180); None = what "
                                         "nvidia-smi reports where a GPU is visible, else unknown (preflight cannot "
                                         "tell whether the weights fit)")

    def engine(self) -> EngineConfig:
        """Just the engine settings (what a child job carries), also from a stage's config."""
        return EngineConfig(**{k: getattr(self, k) for k in EngineConfig.model_fields})


class ExtractConfig(EngineConfig):
    layer_ids: list[int] | None = Field(None, description="aux layer ids; default [2, N//2, N-3]; N is appended")
    rows_per_shard: int = 64
    shards_per_group: int | None = Field(None, description="shards one engine child runs (one model load); "
                                                             "None = spread evenly over parallel_groups")
    parallel_groups: int = Field(1, ge=1, description=">1: groups fan out to the extract-group deployment (GPU pool)")
    storage_dtype: Literal["auto", "bf16", "fp8"] = Field(
        "auto", description="records' hidden states: bf16, or fp8 (float8_e4m3fn + a per-token scale, half the bytes); "
        "auto = fp8 for targets with hidden size >= 4096, else bf16, resolved by preflight from the target's "
        "config.json (records/contracts.storage_dtype_for)")
    engine_tokens_per_s: float | None = Field(None, gt=0, description="prefill tokens/s of one extract engine (an "
                                              "earlier run's report.json stages.extract tokens_per_s / parallel_groups): "
                                              "preflight states the write bandwidth the store needs for "
                                              "parallel_groups engines; None = not stated")
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    timeout_s: float = Field(3600.0, description="deadline of one extract child (one group) when shard_timeout_s "
                             "is not set")
    shard_timeout_s: float | None = Field(None, gt=0, description="deadline per shard: a group's child gets "
                                          "start_timeout_s + shard_timeout_s x its shards (a 1T model's 18-minute "
                                          "load counts once, and a large group is not cut off by a fixed deadline)")
    start_timeout_s: float = Field(3600.0, gt=0, description="engine start-up allowance of a child when "
                                   "shard_timeout_s is set")
    retries: int = 2
    scratch_dir: str | None = Field(None, description="fast local dir for vLLM's per-request files; "
                                    "default <extract version dir>/.scratch")
    engine_in_process: bool | None = Field(None, description="vLLM engine core inside the extract child "
                                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0); None = on CPU with TP 1")
    connector_module: str = Field("eagle3_pipeline.extract.connector",
                                  description="module of the vLLM KV connector that writes hidden states")
    connector_name: str = Field("Eagle3HiddenStatesConnector", description="class name of that connector")
    fingerprints: bool = Field(True, description="store vLLM's top-2 next-token logprobs per token beside each record "
                               "(fingerprints/fp_{i}.safetensors): verify checks every row's final layer against them")
    record_pool: bool = Field(True, description="link records of rows already extracted (any version of the dataset, "
                              "same model/layers/storage/engine numerics) from the record pool instead of extracting "
                              "them again (pool.py)")
    invariance_rows: int = Field(2, ge=0, description="rows of each shard group prefilled again alone at the end of the "
                                 "group (same engine, batch of one) and compared with the batched records; verify judges")


SkippableCheck = Literal["reference", "fingerprint", "state_sketch", "prediction", "identity", "norm_bounds",
                         "invariance", "confirmation"]
# check -> (the setting that turns it off, what the run can no longer catch without it)
OFF_SWITCHES: dict[str, tuple[str, str]] = {
    "reference": ("verify.reference_samples: 0", "a forward computed wrongly (wrong positions, context, KV or kernel): "
                  "the only check that recomputes rows with the target"),
    "prediction": ("verify.prediction_max_z: null", "rows whose states the target's own next-token predictions "
                   "disagree with, on every row rather than a sample"),
    "identity": ("verify.identity_max_z: null", "an aux slot holding another layer than the one configured"),
    "norm_bounds": ("verify.norm_bounds_samples: 0", "records with states far outside the version's norms"),
    "confirmation": ("verify.confirm_rows: 0", "nothing more, but flagged rows stop the run without the target's "
                     "verdict (false alarms are not cleared)"),
    "invariance": ("extract.invariance_rows: 0", "an engine whose states depend on the batch a row was computed in"),
    "fingerprint": ("extract.fingerprints: false", "a final layer that does not reproduce the target's logits"),
    "state_sketch": ("extract.fingerprints: false", "stored states that differ from what the engine computed "
                     "(transport and storage corruption)"),
}


def switched_off(cfg: PipelineConfig) -> list[str]:
    """The checks this config's settings turn off (OFF_SWITCHES), in their order."""
    v, e = cfg.verify, cfg.extract
    off = {"reference": v.reference_samples == 0, "prediction": v.prediction_max_z is None,
           "identity": v.identity_max_z is None, "norm_bounds": v.norm_bounds_samples == 0,
           "confirmation": v.confirm_rows == 0, "invariance": e.invariance_rows == 0,
           "fingerprint": not e.fingerprints, "state_sketch": not e.fingerprints}
    return [k for k in OFF_SWITCHES if off[k]]


def skipped_checks(cfg: PipelineConfig) -> list[str]:
    """One warning per check this config skips (turned off, or named in verify.allow_skip), with what it could have
    caught: the report's first lines and the console's."""
    names = list(dict.fromkeys(switched_off(cfg) + list(cfg.verify.allow_skip)))
    return [f"check {n} skipped ({OFF_SWITCHES[n][0] if n in switched_off(cfg) else 'verify.allow_skip names it'}): "
            f"this run cannot catch {OFF_SWITCHES[n][1]}" for n in names]


class VerifyConfig(Strict):
    reference_samples: int | None = Field(None, ge=0, description="rows re-computed with the target, streamed layer "
                                          "by layer (0 = skip, noted); None = sized so that a corruption of "
                                          "reference_rate of the rows is caught with probability reference_power "
                                          "(59 rows of a large dataset for 1 in 20 at 95%)")
    reference_rate: float = Field(0.05, gt=0, le=1, description="the share of bad rows the reference sample is "
                                  "sized to catch (verify/reference.py reference_size)")
    reference_power: float = Field(0.95, gt=0, lt=1, description="the probability of catching it")
    reference_memory_gb: float = Field(8.0, gt=0, description="peak RSS allowed to the reference child, which "
                                       "streams the target one decoder layer at a time in its dtype; must hold "
                                       "one layer (Kimi-K2.5: ~17B parameters, ~34 GB in bf16) plus ~1 GB")
    reference_timeout_s: float = Field(7200.0, gt=0, description="deadline of the reference child")
    # the reference's pass/fail criteria, per record and captured layer over its tokens (verify/reference.py
    # _row_problems; the measurements: docs/verification.md, "Calibration")
    reference_max_rel_err: float = Field(0.15, gt=0, description="relative L2 error allowed between a stored layer "
                                         "and the bf16 reference over all its tokens. Clean records measured <= "
                                         "0.073 (tiny MoE, the worst of five targets; dense <= 0.008); the "
                                         "neighbouring layer instead of the asked one gave >= 0.2 and vLLM's CPU "
                                         "rotary kernel 0.2-0.77, so 0.15 sits between, 2x above the clean worst. "
                                         "Unmeasured on a 61-layer bf16 MoE on a GPU (bf16 rounding grows ~sqrt(N))")
    reference_min_mean_cosine: float = Field(0.99, gt=0, le=1, description="mean token cosine a stored layer must "
                                             "reach against the reference. Clean records measured >= 0.9999 (dense "
                                             "and random Qwen3/DeepSeek-V3); vLLM's CPU rotary kernel gave 0.65-0.98 "
                                             "on the trained tiny MoE")
    reference_cos_bound: float = Field(0.95, gt=0, le=1, description="a token 'differs' below this cosine to its "
                                       "reference (counted by reference_max_frac_below). Clean dense records "
                                       "have no token below 0.95; the worst clean MoE token measured 0.969 (MoE "
                                       "routing flips on near-ties move single tokens, corruption moves most)")
    reference_max_frac_below: float = Field(0.10, ge=0, le=1, description="share of a layer's tokens allowed "
                                            "below reference_cos_bound: room for a few MoE routing flips per record "
                                            "while a wrong layer, offset or request, which moves most tokens, fails")
    move_bad_files: bool = Field(True, description="move failing files to hidden_states_failed/ (never deleted)")
    norm_bounds_samples: int = Field(1024, ge=0, description="per-layer median-token-norm bounds are learned from up "
                                     "to N good files spread evenly over every shard (median/MAD in log space); "
                                     "0 = no norm check")
    norm_bounds_factor: float = Field(10.0, gt=0, description="bounds = median x/÷ exp(factor * 1.4826 * MAD) "
                                      "of the log mean token norms")
    norm_bounds_min_ratio: float = Field(1.5, ge=1.0, description="the bounds are never tighter than "
                                         "median x/÷ this ratio")
    # batch invariance: the extract engine re-ran `extract.invariance_rows` rows per group alone; judged here
    invariance_max_rel_err: float = Field(0.1, gt=0, description="per layer, relative L2 error allowed between "
                                          "batched and alone (bf16; fp8 storage uses 4x). Calibrated in verify/invariance.py")
    invariance_min_mean_cosine: float = Field(0.99, description="per layer, mean token cosine required between "
                                              "batched and alone (fp8 storage: 1 - 4 x (1 - this))")
    invariance_max_frac_below: float = Field(0.05, ge=0, le=1, description="per layer, fraction of tokens allowed "
                                             "below cosine 0.9 (MoE routing flips move single tokens, corruption many)")
    # every row, final layer: the stored state against the logits vLLM fingerprinted in the same pass
    fingerprint_min_agreement: float = Field(1.0, ge=0, le=1, description="fraction of a record's tokens whose "
                                             "recomputed top-2 logit margin must match the fingerprint (1.0: "
                                             "every token; clean records agree on all)")
    fingerprint_atol: float = Field(0.005, gt=0, description="logit margin tolerance, absolute floor (logits); fp8 x8")
    fingerprint_rtol: float = Field(0.008, ge=0, description="logit margin tolerance relative to |logit1| + |logit2| "
                                    "(vLLM's bf16 logits: 2^-8; measured <= 0.0042); fp8 x8")
    fingerprint_stol: float = Field(0.02, ge=0, description="logit margin tolerance relative to ||(w1 - w2) * "
                                    "rmsnorm(h)||: the bf16 rounding of the stored state (measured <= 0.0098 on "
                                    "SmolLM2); fp8 x8")
    # every row, aux layers: each slot must look like its own layer (layer_identity.py)
    identity_max_z: float | None = Field(20.0, gt=0, description="largest robust deviation of a record's layer-slot "
                                         "relations from the typical ones (layer_identity.py); None = no identity check")
    prediction_max_z: float | None = Field(3.5, gt=0, description="rows whose next tokens the target's own "
                                           "predictions (the fingerprint's top 2) match this many spreads below the "
                                           "version's median are flagged and recomputed with the target "
                                           "(verify/prediction.py); None = no prediction check (and no surprise "
                                           "signal)")
    prediction_surprise_max_z: float = Field(4.0, gt=0, description="rows the target scores this many spreads more "
                                             "surprised than rows as predictable under a bigram of the data "
                                             "(verify/row_signal.py) are flagged and recomputed with the target; on "
                                             "with the prediction check")
    escalate_rows: int = Field(256, ge=0, description="when the reference finds rows computed wrongly, at most this "
                               "many more rows of the shards they are in are recomputed in a second pass: more bad rows "
                               "named, and the damage's extent (verify/extent.py) judged on more than the sample")
    confirm_rows: int = Field(32, ge=0, description="rows flagged only by learned checks (layer identity, norm "
                              "bounds) that are recomputed with the target before they may stop the run; a row "
                              "the model agrees with is cleared (0: learned checks alone decide)")
    allow_skip: list[SkippableCheck] = Field(
        [], description="checks that may be skipped: those against the model itself when they cannot run here (a hub "
        "name without a local copy, layers transformers cannot build on CPU, logits the fingerprint cannot reproduce; "
        "otherwise such a check fails the gate), and every check a setting turns off (OFF_SWITCHES: a setting that "
        "turns one off without its name here is a config error). extract.fingerprints false turns both fingerprint "
        "and state_sketch off and needs both named here. A skipped check is a warning at the top of the report")
    workers: int | None = Field(None, ge=1, description="threads reading and checking files; None = CPU count "
                                "(max 8), or 1 for records under 4 MB on average")
    online_rows: int = Field(64, ge=1, description="train.mode online: rows whose hidden states are taken from the "
                             "training server (spread over the dataset) and verified like stored records before "
                             "training starts (structure, fingerprints, identity, reference, invariance)")


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
    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="the trainer's autocast dtype (and the hidden states' in its batches): auto = bfloat16 "
        "on cuda and on CPUs with native bf16 (AVX512-BF16 or AMX), float32 on other CPUs, where bf16 matmuls "
        "are emulated (~25x slower than fp32 on an AVX2 core)")
    seed: int = 0
    optimizer: Literal["adamw", "muon"] = "muon"
    loss: str = Field("kl_div", description="speculators loss spec: a name (kl_div, ce, tv, ...) or a JSON dict of weights")
    val_ratio: float = Field(0.1, gt=0.0, lt=1.0,
                             description="last fraction of the rows held out for validation / checkpoint_best")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (smoke runs)")
    num_workers: int = Field(0, ge=0, description="data-loader worker processes (0 on CPU)")
    world_size: int = Field(1, ge=1, description="training processes (torchrun ranks, DDP or FSDP): one per GPU on "
                            "cuda, gloo processes on cpu (each on its own cores); 1 = one plain process")
    sharding: Literal["ddp", "fsdp"] = Field(
        "ddp", description="how the ranks hold the draft, through speculators' distributed trainer: ddp = every rank "
        "a full copy, gradients all-reduced; fsdp = parameters, gradients and optimizer state sharded over the ranks "
        "(its fully_shard, --fsdp-shard), for a draft whose training state does not fit one GPU. fsdp needs 2+ "
        "ranks (nodes x world_size) and one packed row per rank per step (no accumulation). (`train.fsdp: true`, "
        "the older spelling, is read as fsdp)")
    gradient_checkpointing: bool = Field(False, description="recompute draft-layer activations in backward "
                                         "(less memory for long rows, ~30-50% slower backward)")
    log_freq: int = Field(1, ge=1, description="log metrics every N optimizer steps; each logged step synchronizes "
                          "the accelerator, so use ~10+ on GPUs")
    timeout_s: float = 24 * 3600.0
    init: Literal["scratch", "previous"] = Field("scratch", description="on a refresh: train from scratch, or "
                                                 "continue from the previous version's draft (same dataset, model and "
                                                 "layers) for refresh_epochs epochs; scratch when there is none")
    refresh_epochs: int = Field(1, ge=1, description="epochs when continuing from the previous draft (init: previous)")
    mode: Literal["offline", "online", "window"] = Field(
        "offline", description="offline: train on the stored hidden states (extract + verify first); online: the "
        "train stage starts a vLLM server of the target (extract's engine settings, layers and connector) and the "
        "trainer asks it for each row's hidden states, which are deleted once read (bounded disk; nothing stored "
        "for the dataset); window: capture (extract's shards, each verified before it is published) and training "
        "run apart through a window of train.window_shards shards on the store, released once trained on "
        "(pipeline/window_training.py; the store holds the window, not the dataset)")
    window_shards: int = Field(2, ge=2, description="window: extract shards the window holds at most (written, "
                               "verified or being trained on); the trainer reads blocks of half of them while "
                               "capture writes the other half. The store holds about window_shards x "
                               "extract.rows_per_shard x tokens per row x bytes per token (preflight says it)")
    window_bytes: int | None = Field(None, ge=1, description="window: also at most this many bytes of shards; "
                                     "unset: bounded by window_shards only. A shard larger than it can never be "
                                     "captured (preflight refuses the run)")
    online_start_timeout_s: float = Field(1800.0, gt=0, description="online: deadline of the server's start-up "
                                          "(a 1T model loads for ~18 minutes)")
    online_request_timeout_s: float = Field(600.0, gt=0, description="online: deadline of one hidden-state request")
    nodes: int = Field(1, ge=1, description="training nodes, each running world_size ranks (torchrun agents meeting "
                       "through its c10d rendezvous; on Kubernetes an Indexed Job of this many pods, on a machine "
                       "without a cluster as many agents on 127.0.0.1)")
    global_batch_tokens: int | None = Field(
        None, ge=1, description="tokens per optimizer step over every rank (packed rows of max_seq_len), held for "
        "any topology by gradient accumulation: a multiple of nodes x world_size x max_seq_len. Unset: one packed "
        "row per rank, so the batch grows with the topology")
    checkpoint_every_steps: int | None = Field(
        None, ge=1, description="also checkpoint every this many optimizer steps (rank 0 writes, atomically); a "
        "killed run resumes from the last one. Unset: at each epoch's end only")
    rdzv_port: int = Field(29400, ge=1, le=65535, description="nodes > 1: the port of torchrun's c10d rendezvous "
                           "on node 0 (on a machine without a cluster, a free local port is taken instead)")
    rdzv_timeout_s: float = Field(1800.0, gt=0, description="nodes > 1: how long the agents wait for every node "
                                  "to join the rendezvous (a pod that has not started by then fails the set)")
    estimate_after_steps: int = Field(5, ge=1, description="optimizer steps timed before the run's duration is "
                                      "estimated against timeout_s (a warning names the nodes that would fit)")

    @model_validator(mode="before")
    @classmethod
    def _older_spellings(cls, data):
        """`num_gpus` (before world_size counted CPU processes too) is read as `world_size`; `fsdp: true/false`
        (before the sharding choice) as `sharding: fsdp/ddp`."""
        if isinstance(data, dict) and "num_gpus" in data:
            data = dict(data)
            n = data.pop("num_gpus")
            if "world_size" in data and data["world_size"] != n:
                raise ValueError(f"train.num_gpus={n} (deprecated alias) contradicts train.world_size={data['world_size']}")
            data["world_size"] = n
        if isinstance(data, dict) and "fsdp" in data:
            data = dict(data)
            sharding = "fsdp" if data.pop("fsdp") else "ddp"
            if data.get("sharding", sharding) != sharding:
                raise ValueError(f"train.fsdp (deprecated spelling) says {sharding}, train.sharding says {data['sharding']}")
            data["sharding"] = sharding
        return data

    @model_validator(mode="after")
    def _device(self):
        if self.device == "cpu" and self.attention == "flex_attention":
            raise ValueError("train.attention=flex_attention needs train.device=cuda (flex attention has no CPU backward); "
                             "use sdpa or eager on CPU")
        if self.sharding == "fsdp" and self.ranks < 2:
            raise ValueError(f"train.sharding=fsdp shards the draft over the training ranks and needs 2 or more "
                             f"(train.nodes x train.world_size = {self.nodes} x {self.world_size}); one process holds "
                             f"the whole draft: use ddp, or world_size >= 2")
        return self

    def topology_problem(self) -> str | None:
        """Why this topology cannot train the configured global batch (preflight and the train stage say it)."""
        try:
            a = self.accumulation_steps
        except ValueError as e:
            return str(e)
        if self.mode == "window" and (self.ranks > 1 or a > 1):
            return (f"train.mode=window trains in one process without gradient accumulation (its sampler packs "
                    f"the blocks the window holds for one rank); asked nodes {self.nodes} x world_size "
                    f"{self.world_size}, {a} accumulation step(s): set train.nodes=1, train.world_size=1 and leave "
                    f"train.global_batch_tokens unset, or train offline")
        if self.mode == "online" and self.nodes > 1:
            return ("train.mode=online with train.nodes > 1 is not built: the stage's vLLM server serves its own "
                    "node; train offline on several nodes, or online on one")
        if self.sharding == "fsdp" and a > 1:
            return (f"train.sharding=fsdp with gradient accumulation ({a} steps for train.global_batch_tokens "
                    f"{self.global_batch_tokens}) is not built: use DDP, or more nodes")
        return None

    @property
    def ranks(self) -> int:
        """Training processes over every node."""
        return self.nodes * self.world_size

    @property
    def accumulation_steps(self) -> int:
        """Packed rows each rank trains on per optimizer step (global_batch_tokens / ranks / max_seq_len)."""
        if self.global_batch_tokens is None:
            return 1
        per_step = self.ranks * self.max_seq_len
        if self.global_batch_tokens % per_step:
            fits = [n for n in range(1, 65) if self.global_batch_tokens % (n * self.world_size * self.max_seq_len) == 0]
            raise ValueError(f"train.global_batch_tokens {self.global_batch_tokens} is not a multiple of nodes x "
                             f"world_size x max_seq_len = {self.nodes} x {self.world_size} x {self.max_seq_len} = "
                             f"{per_step}: node counts that divide it at this world_size: {fits[:8] or 'none'}")
        return self.global_batch_tokens // per_step

    @property
    def batch_tokens(self) -> int:
        """The global batch in tokens (packed rows of max_seq_len), whatever the topology."""
        return self.global_batch_tokens or self.ranks * self.max_seq_len


class EvaluateConfig(EngineConfig):
    num_prompts: int = 16
    num_speculative_tokens: int = 3
    max_tokens: int = 64
    min_acceptance_length: float = 1.0
    baseline: bool = True
    baseline_ngram: bool = Field(True, description="also measure vLLM's n-gram (prompt lookup) speculation on the same "
                                 "prompts with the same k, greedy decoding and max_tokens: what a user would run "
                                 "instead of training a draft (one more engine; report.json stages.evaluate."
                                 "baseline_ngram, tokens per target step counting every decode step)")
    ngram_prompt_lookup_min: int = Field(2, ge=1, description="n-gram baseline: shortest n-gram looked up")
    ngram_prompt_lookup_max: int = Field(4, ge=1, description="n-gram baseline: longest n-gram looked up")
    baseline_suffix: bool = Field(True, description="also measure vLLM's suffix decoding (`method: suffix`, the "
                                  "arctic-inference backend) on the same prompts with the same k: the strongest "
                                  "training-free option on repetitive and agentic work (one more engine; report.json "
                                  "stages.evaluate.baseline_suffix, or baseline_suffix_unavailable saying why not)")
    suffix_max_tree_depth: int = Field(24, ge=1, description="suffix baseline: depth of its prompt and response trees")
    suffix_max_spec_factor: float = Field(1.0, ge=0, description="suffix baseline: tokens proposed at most per token "
                                          "of the matched suffix (vLLM's suffix_decoding_max_spec_factor)")
    suffix_min_token_prob: float = Field(0.1, ge=0, le=1, description="suffix baseline: only tokens at least this "
                                         "likely in the tree are proposed")
    check_lossless: bool = Field(True, description="compare the trained draft's greedy tokens with a reference "
                                 "decoding of the same prompts (lossless_reference)")
    lossless_reference: Literal["untrained", "plain"] = Field(
        "untrained", description="untrained: the baseline draft's run (its drafts are all rejected, so its tokens "
        "are the target's own greedy choices; no extra engine); plain: one more target load without speculation "
        "(also the reference when baseline is off)")
    lossless_gate: bool = Field(False, description="fail the gate on a lossless mismatch (bf16 near-ties can flip "
                                "an argmax between batched verification and one-token decoding)")
    sample_texts: int = Field(4, description="generated texts of the first N prompts kept in the record")
    compare_previous: bool = Field(False, description="also evaluate the previous version's draft (lineage: newest "
                                   "other version of this dataset/model/layers with a draft) on the same held-out "
                                   "prompts, in the same child; the refresh flow turns it on")
    max_model_len: int | None = Field(None, description="default: longest prompt + max_tokens + drafts")
    prompts: str | None = Field(None, description="prompt set: a JSONL/JSON/Parquet file, a directory of them, a "
                                "save_to_disk dir or a hub dataset name; rows with `prompt`, `turns` (first turn) or "
                                "`messages`, optional `category`, `system`, `tools` (evaluate/prompts.py); rendered "
                                "with the target's chat template. None = prepare's held-out prompts")
    prompts_split: str = Field("train", description="split of a hub dataset or a saved DatasetDict (evaluate.prompts)")
    turns: Literal["first", "all"] = Field("first", description="first: each row's first user turn; all: also its "
                                           "later turns (MT-Bench's second), each asked after the target's own greedy "
                                           "answer to the turns before, in category '<category> · turn <n>' (one more "
                                           "engine run per later turn)")
    turn_answer_max_tokens: int = Field(256, ge=1, description="evaluate.turns=all: tokens of the target's answer to "
                                        "a turn before a later one (answers cut there are counted in the prompt set)")
    temperature: float | None = Field(0.7, gt=0, description="also measure the trained draft's acceptance at this "
                                      "sampling temperature (a second pass in the same engine, seeded); None = "
                                      "temperature 0 only")
    sampling_seed: int = Field(0, description="seed of the sampled pass (prompt i uses seed + i)")
    speedup: bool = Field(True, description="measure output tokens/s with the trained draft and with the target "
                          "alone (one more engine, same settings; timed generate calls only)")
    speedup_rounds: int = Field(3, ge=1, description="timed generate passes per engine for the speed-up (median, "
                                "min-max reported)")
    timeout_s: float = Field(3600.0, description="deadline of the evaluate child (all its engine loads together)")
    engine_in_process: bool | None = Field(None, description="vLLM engine core inside the evaluate child "
                                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0, passive OpenMP waits); "
                                           "None = on a CPU build of vLLM with TP 1")

    @model_validator(mode="after")
    def _ngram_window(self) -> "EvaluateConfig":
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(f"evaluate.ngram_prompt_lookup_min={self.ngram_prompt_lookup_min} must be <= "
                             f"ngram_prompt_lookup_max={self.ngram_prompt_lookup_max}")
        return self


class RegenerateConfig(EngineConfig):
    """The optional regenerate stage (regenerate/): before tokenization the target answers the user turns
    of every source conversation itself (its own chat template, these sampling settings), so the draft
    learns the target's own answers. Which turns are answered and what is kept: regenerate/turns.py."""
    enabled: bool = Field(False, description="regenerate the assistant replies with the target before prepare "
                          "(prepare then reads the regenerated dataset instead of prepare.sources)")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1, description="tokens the target may generate per answered turn")
    seed: int = Field(0, description="base of the per-request seeds (hash of seed, conversation id and turn): a "
                      "row's answer does not depend on its batch or shard")
    thinking: bool | None = Field(None, description="thinking on/off where the chat template has a switch "
                                  "(passed as the template variable `thinking_kwarg`); None = the template's default")
    thinking_kwarg: str = Field("enable_thinking", description="the template's thinking switch (Qwen3: "
                                "enable_thinking; Kimi-K2 / DeepSeek-V3.1: thinking)")
    chat_template_kwargs: dict[str, bool | int | float | str | None] = Field(
        {}, description="further variables for the chat template when it renders the prompts")
    reasoning_parser: str | None = Field(None, description="vLLM reasoning parser (e.g. deepseek_r1, qwen3, kimi_k2) "
                                         "that splits a generated answer into reasoning_content and content, for "
                                         "templates that render reasoning themselves; None = the answer is content")
    max_turns: int | None = Field(None, ge=1, description="text replies answered per conversation (the conversation "
                                  "is cut after the last one); None = all")
    max_history_tokens: int | None = Field(None, ge=1, description="a later turn whose prompt (the history) has more "
                                           "tokens is not answered: the conversation ends after the turns answered "
                                           "so far (set it near prepare.max_length: training cuts longer rows); "
                                           "None = every turn while it fits max_model_len")
    on_repetition: Literal["keep", "end"] = Field("keep", description="an answer that is mostly a loop (fewer than "
                                                  "half of its 8-token spans distinct): keep it, or end the "
                                                  "conversation before that turn (a looping first answer quarantines "
                                                  "the conversation); counted either way")
    on_length: Literal["quarantine", "keep"] = Field("quarantine", description="an answer cut off at max_tokens (or "
                                                     "max_model_len): quarantine the conversation, or keep the cut answer")
    max_model_len: int | None = Field(None, ge=16, description="engine context; None = the model's. A prompt that "
                                      "does not fit is quarantined")
    max_num_seqs: int = Field(64, ge=1, description="requests the engine batches")
    rows_per_shard: int = Field(256, ge=1, description="source rows per published shard (the unit a rerun skips)")
    timeout_s: float = Field(3600.0, gt=0, description="deadline of one regenerate child (all its shards)")
    retries: int = Field(2, ge=0, description="task retries (a retry does only the unpublished shards)")


class ClusterConfig(Strict):
    """How long a stage's pod may take to start on the cluster (cluster.start_deadline_s): a run whose pod
    has not started by then is cancelled with the pod's own reason (Unschedulable, ImagePullBackOff, ...)."""
    gpu_node_scale_up_s: float = Field(900.0, gt=0, description="a GPU node's provisioning by the autoscaler, "
                                       "its driver and device plugin becoming ready")
    cpu_node_scale_up_s: float = Field(300.0, gt=0, description="a CPU node's provisioning")
    image_gib: float = Field(20.0, gt=0, description="the compressed image a node pulls (CUDA, torch, vLLM)")
    node_pull_gib_per_s: float = Field(0.1, gt=0, description="one node's image pull rate")
    registry_gib_per_s: float = Field(1.0, gt=0, description="what the registry serves to all nodes pulling at once")
    start_margin_s: float = Field(300.0, ge=0, description="the container's own start (mounts, the flow's imports)")


class PipelineConfig(Strict):
    name: str
    store: str = "runs/store"
    target: TargetConfig
    prepare: PrepareConfig
    regenerate: RegenerateConfig = RegenerateConfig()
    extract: ExtractConfig = ExtractConfig()
    verify: VerifyConfig = VerifyConfig()
    vocab: VocabConfig = VocabConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    cluster: ClusterConfig = ClusterConfig()
    gpu_stages: Literal["in_flow", "deployments"] = Field(
        "in_flow", description="where verify, train and evaluate run: in the flow's own process, or as runs of "
        "their deployments (verify-stage, train-stage, evaluate-stage) that the work pool places on GPU nodes, "
        "each with job variables derived from this config (pipeline/jobs.py)")

    @model_validator(mode="after")
    def _no_silent_off_switch(self):
        unnamed = [n for n in switched_off(self) if n not in self.verify.allow_skip
                   and n not in ("fingerprint", "state_sketch")]  # extract.fingerprints false: preflight says it, naming both
        if unnamed:
            raise ValueError("; ".join(f"{OFF_SWITCHES[n][0]} turns the {n} check off, and then this run cannot catch "
                                       f"{OFF_SWITCHES[n][1]}: name it to go on without it (verify.allow_skip: [{n}])"
                                       for n in unnamed))
        return self


def _set_dotted(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override {key!r}: {p!r} is not a mapping")
    d[parts[-1]] = value


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(loc: tuple) -> list[str]:
    """The keys a config section accepts (for "did you mean" on an unknown key)."""
    model: type[BaseModel] | None = PipelineConfig
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        ann = field.annotation if field else None
        args = getattr(ann, "__args__", ()) or (ann,)
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return list(model.model_fields) if model else []


def describe_validation_error(e: ValidationError) -> list[str]:
    """One line per problem: `dotted.key: what is wrong (found <value>)`."""
    lines = []
    for err in e.errors():
        key, kind = _dotted(err["loc"]) or "<top level>", err["type"]
        if kind == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), _fields_at(err["loc"][:-1]), n=1)
            lines.append(f"{key}: unknown key" + (f" (did you mean {close[0]!r}?)" if close else ""))
        elif kind == "missing":
            lines.append(f"{key}: required key missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            found = repr(err.get("input"))
            lines.append(f"{key}: {msg}" + ("" if kind == "value_error" else f" (found {found[:80]})"))
    return lines


def _override(data: dict, overrides) -> None:
    """Apply `key.sub=value` overrides (values parsed as YAML) to a config's raw mapping."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        k, v = ov.split("=", 1)
        try:
            value = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {ov!r}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None
        _set_dotted(data, k.strip(), value)


def apply_overrides(cfg: PipelineConfig, overrides: list[str] | tuple[str, ...]) -> PipelineConfig:
    """`cfg` with `key.sub=value` overrides (as load_config's); `cfg` itself when there are none."""
    if not overrides:
        return cfg
    data = cfg.model_dump(mode="json", exclude_unset=True)
    _override(data, overrides)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"config {cfg.name} with overrides: " + "; ".join(describe_validation_error(e))) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Load a YAML config and apply `key.sub=value` overrides (values parsed as YAML).
    Raises ConfigError naming the file and every bad key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config {path}: file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config {path}: YAML syntax error{where}: {getattr(e, 'problem', None) or e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping of keys at the top level, found {type(data).__name__}")
    _override(data, overrides)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        lines = describe_validation_error(e)
        raise ConfigError(f"config {path}{' with overrides' if overrides else ''}: " + "; ".join(lines)) from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def target_problems(target: TargetConfig) -> list[str]:
    """Why `target.model` or `target.tokenizer` is not a local model (or tokenizer) directory: a typo or an
    unmounted volume is named here, not as a hub error at prepare. With `hub: true` a name that is no local path
    is left to the hub."""
    out = []
    for key, path, wanted in (("target.model", target.model, ("config.json",)),
                              ("target.tokenizer", target.tokenizer, TOKENIZER_FILES)):
        p = Path(path).expanduser()
        if target.hub and not p.exists():
            continue
        what = f"a local model directory holding {' or '.join(wanted)}"
        if not p.exists():
            hint = "" if target.hub else "; a hub id needs target.hub: true"
            out.append(f"{key} {path}: no such file or directory (resolved to {p.resolve()}), expected {what}{hint}")
        elif not p.is_dir():
            out.append(f"{key} {path}: is a file, expected {what}")
        elif not any((p / name).exists() for name in wanted):
            out.append(f"{key} {path}: is a directory without {' or '.join(wanted)}, expected {what}")
        if key == "target.model" and target.tokenizer == target.model and out:
            break  # the tokenizer is the same path: said once
    return out


def check_target(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg`, or a ConfigError naming every target path that is not what it should be (before any stage)."""
    if problems := target_problems(cfg.target):
        raise ConfigError("config: " + "; ".join(problems))
    return cfg


def hub_token(target: TargetConfig) -> str | None:
    """The hub token from the environment variable the config names (None when unset or empty).
    Pass it to hub calls as `token=`; never log it or write it anywhere."""
    return os.environ.get(target.hub_token_env) or None
