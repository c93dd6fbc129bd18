"""The records the stages return that the report reads: a stage's result model lives here, on the ground floor,
so that the report (a stage too, which imports no sibling stage) reads the same model the stage returns and
declares no field of it again (report/record.py; docs/decisions/report-from-runreport.md). Only the models: the
stages' logic stays in their packages, which re-export their model under its old name.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.config import SourceConfig

UNTRAINED_DIR = "untrained_draft"  # in the train dir: the random-weights baseline of the same architecture


class VocabResult(BaseModel):
    draft_vocab_size: int
    target_vocab_size: int
    coverage: float  # fraction of supervised (loss-masked) target tokens the draft vocab covers
    distinct_tokens: int  # target ids seen at least once in supervised positions
    padded: int  # ids added without any supervised occurrence (fewer than K distinct tokens)
    forced_special: list[int]  # special ids that were below the frequency cut and were put in anyway
    d2t_path: Path
    t2d_path: Path
    dir: str = ""  # the vocab directory (absolute)


class RegenerateResult(BaseModel):
    version: str
    dir: str
    rows_dir: str  # prepare reads this directory (prepare_config)
    quarantine: str
    manifest: str
    rows_in: int
    rows_out: int
    rows_quarantined: int
    tokens_generated: int  # every generated token, also of answers whose conversation was quarantined
    prompt_tokens: int
    turns_regenerated: int
    kept_tool_turns: int
    quarantine_kinds: dict[str, int]
    turns_rendered_differently: int  # answered turns whose rendering is not prompt + generated text
    answers_cut: dict[str, int] = {}  # answers kept though cut short (on_length: keep), by the limit hit
    conversations_ended: int = 0  # ended before a turn whose history was past max_history_tokens
    answers_repeating: int = 0  # answers that are mostly a loop (turns.repeats_itself), kept or not (on_repetition)
    on_repetition: str = "keep"  # what was done with them (regenerate.on_repetition)
    shards_total: int
    shards_computed: int  # by this call
    single_pass: bool
    single_pass_reason: str
    output_token_states: bool | None  # the installed vLLM's capability (None: not checked)
    thinking: dict
    generate_s: float  # engine time of all shards of the version
    rows_per_s: float
    tokens_per_s: float
    engine_start_s: float | None = None  # this call's engine start (None: no engine started)
    cached: bool = False

    def sources(self) -> list[SourceConfig]:
        """What prepare reads instead of prepare.sources: the regenerated rows (OpenAI format)."""
        return [SourceConfig(path=self.rows_dir, format="openai")]


class ExtractResult(BaseModel):
    content_key: str
    dir: str
    layer_ids: list[int]
    shards_total: int
    shards_published: int
    tokens: int
    tokens_per_s: float  # published tokens / summed shard seconds (engine start-up excluded)
    bytes_on_disk: int
    hidden_states_dir: str
    manifest: str
    rows_extracted: int = 0     # rows the engine extracted for this version (with `since`: in this run)
    rows_reused: int = 0        # rows linked from the record pool instead (with `since`: in this run)
    rows_from_store: int = 0    # with `since`: rows of shards published before this run (nothing done now)
    cached: bool = False        # with `since`: every shard was published before this run


class OnlineResult(BaseModel):
    """An online run's server and its verified sample (train/online.py)."""
    endpoint: str
    server_start_s: float
    sample_rows: list[int]
    sample_tokens: int
    sample_seconds: float
    sample_bytes: int             # the verified sample's records + fingerprints (kept)
    scratch_peak_bytes: int       # most bytes of in-flight hidden-state files seen in the server's scratch dir
    hidden_states_peak_bytes: int  # sample_bytes + scratch_peak_bytes: hidden states on disk at the worst moment
    offline_bytes_estimate: int   # what the stored dataset would take (bf16 records of every row)
    work_dir: str


class OnlineRowChecks(BaseModel):
    """How every row the trainer read from the server was judged (pipeline/online_training.confirm_online_flags)."""
    fingerprint: bool
    state_sketch: bool
    identity: bool
    flagged: list[int] = []       # rows the layer profiles flagged, kept out of training
    cleared: list[int] = []       # of those, the rows the target recomputed and agreed with
    unavailable: list[int] = []   # rows the server could not deliver (not trained on)


class OnlineRecord(OnlineResult):
    """What train's record keeps of an online run: the server and sample, the sample's verify, the row checks."""
    verify: dict = {}             # the sample's VerifyResult (report.json keeps it as written)
    row_checks: OnlineRowChecks | None = None


class WindowRecord(BaseModel):
    """What train's record keeps of a window run (pipeline/window_training.py): the window's peak against the
    dataset's bytes, its shards, and every shard's verify merged."""
    dir: str
    max_shards: int
    max_bytes: int | None = None
    passes: int
    shards: int
    published: int
    released: int
    peak_shards: int
    peak_bytes: int
    dataset_bytes: int
    validation_bytes: int
    capture_seconds: float
    verify: dict = {}             # the merged VerifyResult (report.json keeps it as written)


class TrainResult(BaseModel):
    mode: str = "offline"  # offline: stored hidden states; online: from a vLLM server started by the stage
    world_size: int = 1  # training processes (torchrun ranks; GPUs on cuda, gloo processes on cpu)
    steps: int
    final_loss: float | None
    first_loss: float | None
    val_loss: float | None
    final_acc: list[float | None] | None  # full-sequence accuracy per TTT step, last logged train step
    tokens_per_s: float  # training throughput over every logged step (fetch + fwd + bwd + optimizer)
    tokens: int
    epochs_done: int
    resumed_from_epoch: int  # -1: fresh start
    checkpoint_best: Path
    checkpoint_last: Path
    metrics: Path
    export_checked: bool  # export_check passed on checkpoint_best (False: target is not a local directory)
    dir: str = ""  # the train directory (absolute): checkpoints/, metrics.jsonl, train.log, untrained_draft/
    engine_start_s: float | None = None  # this attempt's child start-up before its first step (None: reused)
    init: str = "scratch"  # scratch, or previous: initialised from the previous version's draft (train.init)
    previous_draft: str | None = None    # that draft's checkpoint (lineage)
    previous_version: str | None = None  # "<prepare version>/<extract version>" it was trained on
    hidden_states_peak_bytes: int | None = None  # online: most bytes of hidden states on disk (train/online.py)
    online: OnlineRecord | None = None  # online: server start-up, verified sample, disk peak, its verify, row checks
    window: WindowRecord | None = None  # window: the window's peak against the dataset's bytes, its shards, its verify
    cached: bool = False  # every epoch was trained before this call (its checkpoints were found): nothing trained now
    nodes: int = 1  # training nodes (torchrun agents meeting through c10d; train/topology.py)
    ranks_per_node: int = 1
    sharding: str = "ddp"  # ddp: a copy of the draft per rank; fsdp: sharded over the ranks (train.sharding)
    accumulation_steps: int = 1  # packed rows each rank trains on per optimizer step
    global_batch_tokens: int | None = None  # tokens per optimizer step over every rank: the same on any topology
    checkpoint_every_steps: int | None = None  # step checkpoints (None: at epoch ends only)
    resumed_from_step: int = 0  # the optimizer step this attempt resumed at (0: a fresh start)
    fit: dict | None = None  # topology.Fit: the duration estimated from the first steps against train.timeout_s

    def untrained_dir(self) -> Path:
        """The random-weights draft of the same architecture and vocab: evaluate's baseline."""
        return Path(self.dir) / UNTRAINED_DIR
