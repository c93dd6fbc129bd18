"""What the train parent and its child share: the job file (JOB.json: `TrainJob`, written by stage.py
with `model_dump_json`, read by worker.py with `model_validate_json`) and the child's result file
(`TrainOutput`). Light imports only: `python -m eagle3_pipeline.train.worker` imports this first."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core.config import TargetConfig, TrainConfig


class RowChecksSpec(BaseModel):
    """What every row the online trainer reads is judged by, beyond its structure (train/online_data.py):
    the target's final-layer fingerprint on every token and the layer profiles the verify gate learned
    from the sample. Rows that fail are written to `rejected_path` and stop training; rows only the
    learned profiles flag are kept out of training, written as records under `flagged_dir` and confirmed
    with the target itself by the stage afterwards."""
    model_config = ConfigDict(extra="forbid")
    model_dir: str
    norm_eps: float
    atol: float
    rtol: float
    stol: float
    slack: float = 1.0
    layer_ids: list[int]
    storage_dtype: str
    identity: dict | None = None  # verify's identity_profile of the sample (median, scale, max_z); None: not judged
    fingerprint: bool = True      # every row's final layer against the target's logits (off: verify.allow_skip names it)
    sketch: bool = True           # every row's states against the server engine's sketch (off: allow_skip names it)
    rejected_path: str
    flagged_path: str             # one JSON line per flagged row
    flagged_dir: str              # their records (hidden_states/hs_{row}.safetensors of a sample-shaped dir)


class OnlineSource(BaseModel):
    """Online training: the running vLLM server that the trainer asks for each row's hidden states."""
    model_config = ConfigDict(extra="forbid")
    endpoint: str
    model: str
    request_timeout_s: float
    max_in_flight: int = 16  # rows of a packed batch requested at once (train/online_data.py)
    hidden_size: int | None = None  # checked on every row the server sends
    cache_dir: str = ""  # where the server's files land; each is deleted once read
    checks: RowChecksSpec | None = None  # None: each row's structure only


class WindowSource(BaseModel):
    """Window training: the train rows come from a capture window (train/window.py) as capture publishes them,
    in the order of `plan` (shard key, its train rows); validation rows from `hidden_states_dir`."""
    model_config = ConfigDict(extra="forbid")
    dir: str
    max_shards: int
    max_bytes: int | None = None
    passes: int = 1
    plan: list[tuple[str, list[int]]]
    wait_s: float = 600.0


class TrainJob(BaseModel):
    """JOB.json of one train child. mode "train" trains (and writes the untrained baseline beside);
    mode "untrained" writes only a randomly initialised draft of the same architecture to out_dir."""
    model_config = ConfigDict(extra="forbid")
    mode: Literal["train", "untrained"]
    train: TrainConfig
    target: TargetConfig
    d2t_path: str
    t2d_path: str
    aux_layer_ids: list[int]
    out_dir: str
    result_path: str
    tokenized_dir: str | None = None  # mode "train": the rows (datasets.save_to_disk)
    hidden_states_dir: str | None = None  # mode "train", offline: hs_{i}.safetensors
    save_path: str | None = None  # mode "train": the epoch checkpoints
    metrics_path: str | None = None  # mode "train": metrics.jsonl
    init_from: str | None = None  # a previous draft's checkpoint to start from (train.init: previous)
    untrained_dir: str | None = None  # the evaluate stage's baseline, written by the same child
    online: OnlineSource | None = None  # None: offline, the stored records
    window: WindowSource | None = None  # train rows from a capture window (train/window_sampler.py)


class TrainOutput(BaseModel):
    """The result file of a mode "train" child (rank 0), read by the parent."""
    steps: int
    world_size: int
    epochs_done: int
    resumed_from_epoch: int
    resumed_from_step: int = 0  # the optimizer step this attempt started at (a step or epoch checkpoint's)
    checkpoint_best: str
    checkpoint_best_epoch: int
    checkpoint_last: str
    metrics: str
    wall_seconds_this_attempt: float
    startup_s: float
    logged_steps: int
    first_loss: float | None
    final_loss: float | None
    final_acc: list[float | None] | None
    val_loss: float | None
    val_acc: list[float | None] | None
    tokens: int
    train_seconds: float
    tokens_per_s: float


class UntrainedOutput(BaseModel):
    """The result file of a mode "untrained" child."""
    checkpoint: str
