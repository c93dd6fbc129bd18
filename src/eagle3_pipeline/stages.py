"""One function per pipeline stage: the glue between configs, the run store and the stage cores.

Each `stage_*` takes the config and the typed records of the stages before it (pydantic models:
`PrepareResult`, `PreflightResult`, the `ExtractVersion` of layout.py, `VerifyResult`, `VocabResult`,
`TrainResult`), calls one core function, and returns its own record. Prefect persists and shows these
models as they are (tasks/ wraps each function; tests call them directly). No Prefect here.
Where things go is the ExtractVersion's business (layout.py): vocab = `version.vocab_dir(K)`,
training = `version.train_dir(train_key)` (keyed by everything that determines the draft, so a second
run with the same inputs reuses the checkpoint and an interrupted one resumes).
Test hook: `faults.fail_once` at the start of prepare, verify and vocab (EAGLE3_TEST_FAIL_ONCE).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.data.prepare import PrepareResult
from eagle3_pipeline.faults import fail_once
from eagle3_pipeline.layout import ExtractVersion, plan_extract
from eagle3_pipeline.preflight import PreflightResult
from eagle3_pipeline.store import content_key, dir_lock

__all__ = ["plan_extract", "stage_regenerate", "stage_prepare", "stage_preflight", "stage_gpu_gate", "stage_extract_group",
           "stage_extract_summary", "stage_extract", "stage_verify", "stage_vocab", "train_key", "stage_train",
           "stage_evaluate", "first_quarantined", "heldout_prompts"]


def stage_regenerate(cfg: PipelineConfig, log=print):
    """The optional regenerate stage: the target answers the sources' turns (regenerate/); its
    RegenerateResult is what stage_prepare then reads instead of prepare.sources."""
    from eagle3_pipeline.regenerate import regenerate

    return regenerate(cfg.regenerate, cfg.prepare, cfg.target, Path(cfg.store), log=log)


def stage_prepare(cfg: PipelineConfig, log=print, regenerated=None) -> PrepareResult:
    """Tokenize prepare.sources, or with `regenerated` (a RegenerateResult) the regenerated rows."""
    from eagle3_pipeline.data.prepare import prepare

    fail_once("prepare")
    prep_cfg = cfg.prepare
    if regenerated is not None:
        from eagle3_pipeline.regenerate import prepare_config

        prep_cfg = prepare_config(cfg.prepare, regenerated)
        log(f"prepare: reading the regenerated rows of version {regenerated.version} ({regenerated.rows_dir})")
    return prepare(prep_cfg, cfg.target, Path(cfg.store), log=log)


def first_quarantined(prep: PrepareResult, n: int) -> list[dict]:
    """The first `n` quarantine entries (source, row, reason) of a prepare record."""
    out = []
    with open(prep.quarantine) as f:
        for line in f:
            if len(out) >= n:
                break
            r = json.loads(line)
            out.append({"source": r["source"], "row": r["row"], "reason": r["reason"]})
    return out


def stage_preflight(cfg: PipelineConfig, prep: PrepareResult, log=print) -> PreflightResult:
    from eagle3_pipeline.preflight import preflight

    return preflight(cfg, prep.tokens, Path(prep.dir), log=log)


def stage_gpu_gate(where: str, log=print):
    from eagle3_pipeline.gpu import gpu_gate

    rec = gpu_gate(log=lambda m: log(f"[{where}] {m}"))
    return rec.model_copy(update={"where": where})


def stage_extract_group(cfg: PipelineConfig, version: ExtractVersion, shard_ids: list[int], force: bool = False,
                        log=print, on_shard=None) -> list:
    """Publish shards `shard_ids` of `version` with one engine child: list[extract.shards.ShardRecord]."""
    from eagle3_pipeline.extract.shards import extract_group

    return extract_group(cfg.extract, cfg.target, version, shard_ids, log=log, force=force, on_shard=on_shard)


def stage_extract_summary(version: ExtractVersion):
    """The ExtractResult of `version`, from its manifest."""
    from eagle3_pipeline.extract.shards import summarize

    return summarize(version.path)


def stage_extract(cfg: PipelineConfig, version: ExtractVersion, log=print):
    """The whole extract stage without Prefect: every group in turn (tests, `eagle3 extract`)."""
    for group in version.groups:
        stage_extract_group(cfg, version, group, log=log)
    return stage_extract_summary(version)


def stage_verify(cfg: PipelineConfig, version: ExtractVersion, log=print):
    """The verify gate: raises VerifyFailed naming every bad record; returns the VerifyResult."""
    from eagle3_pipeline.verify.gate import check_verify_gate, verify

    fail_once("verify")
    res = verify(cfg.verify, cfg.target, version, log=log, extract_cfg=cfg.extract)
    check_verify_gate(res)
    return res


def stage_vocab(cfg: PipelineConfig, prep: PrepareResult, version: ExtractVersion, log=print):
    from eagle3_pipeline.data.prepare import load_tokenizer
    from eagle3_pipeline.vocab import build_vocab

    fail_once("vocab")
    tok = load_tokenizer(cfg.target)
    return build_vocab(cfg.vocab, Path(prep.token_freq), version.dims.vocab_size,
                       version.vocab_dir(cfg.vocab.draft_vocab_size),
                       special_token_ids=[t for t in (tok.eos_token_id,) if t is not None])


# Train settings that change how a run is watched, not the draft it produces: a new value resumes
# the same checkpoint dir instead of training from scratch.
TRAIN_KEY_EXCLUDE = frozenset({"log_freq", "timeout_s", "num_workers"})


def train_key(cfg: PipelineConfig, version: ExtractVersion) -> str:
    """Keyed by the data, the vocab and the train settings; with `train.init: previous` (and a previous
    draft to continue from) also by that draft (lineage.previous_draft)."""
    vocab_dir = version.vocab_dir(cfg.vocab.draft_vocab_size).resolve()
    prev = previous_for(cfg, version)
    train = cfg.train.model_dump(exclude=set(TRAIN_KEY_EXCLUDE) | ({"init", "refresh_epochs"} if prev is None else set()))
    return content_key({"extract": version.content_key, "vocab": str(vocab_dir), "train": train,
                        **({"previous": prev.checkpoint} if prev else {})})


def previous_for(cfg: PipelineConfig, version: ExtractVersion):
    """The previous version's draft this training continues from (train.init: previous), or None."""
    from eagle3_pipeline.lineage import previous_draft

    return previous_draft(version) if cfg.train.init == "previous" else None


def stage_train(cfg: PipelineConfig, version: ExtractVersion, voc, log=print):
    from eagle3_pipeline.train import train_draft
    from eagle3_pipeline.verify.gate import require_verified

    require_verified(version)
    prev = previous_for(cfg, version)
    if cfg.train.init == "previous" and prev is None:
        log("train: train.init=previous but no other version of this dataset/model/layers has a trained draft; "
            "training from scratch")
    tcfg = cfg.train if prev is None else cfg.train.model_copy(update={"epochs": cfg.train.refresh_epochs})
    if prev is not None:
        log(f"train: continuing from the draft of version {prev.prepare_version}/{prev.extract_version} "
            f"({prev.checkpoint}) for {tcfg.epochs} epoch(s)")
    return train_draft(tcfg, cfg.target, version, Path(voc.dir), version.train_dir(train_key(cfg, version)),
                       log=log, previous=prev)


def heldout_prompts(prep: PrepareResult, n: int) -> list[list[int]]:
    lines = Path(prep.heldout).read_text().splitlines()
    return [json.loads(line)["prompt_ids"] for line in lines[:n]]


def stage_evaluate(cfg: PipelineConfig, prep: PrepareResult, version: ExtractVersion, voc, tr, run_dir: Path,
                   log=print):
    from eagle3_pipeline.evaluate import check_acceptance_gate, evaluate_pair
    from eagle3_pipeline.train import UNTRAINED_DIR, make_untrained_draft

    prompts = heldout_prompts(prep, cfg.evaluate.num_prompts)
    if not prompts:
        raise RuntimeError(f"evaluate: no held-out prompts in {prep.heldout} (prepare.heldout_rows is 0?)")
    untrained = None
    if cfg.evaluate.baseline:
        untrained = Path(tr.dir) / UNTRAINED_DIR  # the train child wrote it; made here for older train dirs
        with dir_lock(Path(tr.dir), f"train dir {tr.dir}", log):  # written once, never under a reader
            if not (untrained / "config.json").exists():
                make_untrained_draft(cfg.target, version, Path(voc.dir), untrained, cfg.train)
    from eagle3_pipeline.lineage import previous_draft

    prev = previous_draft(version) if cfg.evaluate.compare_previous or cfg.train.init == "previous" else None
    if prev is not None:
        log(f"evaluate: also the previous version's draft {prev.checkpoint} on the same held-out prompts")
    rep = evaluate_pair(cfg.evaluate, cfg.target, Path(tr.checkpoint_best), untrained, prompts,
                        Path(run_dir) / "evaluate", log=log, previous_dir=Path(prev.checkpoint) if prev else None)
    check_acceptance_gate(rep, cfg.evaluate)
    return rep
