"""One function per pipeline stage: the glue between configs, the run store and the stage cores.

Each `stage_*` takes the config and the small records (dicts) of the stages before it, calls one
core function, and returns its record as a plain dict (what Prefect tasks persist and report.json
shows). No Prefect here: tasks/ wraps these, and tests call them directly.
Derived locations: extract dir = <prepare dir>/<model>/<extract key>/; vocab = <extract dir>/vocab/K<K>/;
training = <extract dir>/train/<train key>/ (keyed by everything that determines the draft, so a
second run with the same inputs reuses the checkpoint and an interrupted one resumes).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.store import content_key, dir_lock, extract_dir, extract_key, model_fingerprint


def stage_prepare(cfg: PipelineConfig, log=print) -> dict:
    from eagle3_pipeline.data.prepare import prepare

    return prepare(cfg.prepare, cfg.target, Path(cfg.store), log=log).model_dump()


def first_quarantined(prep: dict, n: int) -> list[dict]:
    """The first `n` quarantine entries (source, row, reason) of a prepare record."""
    out = []
    with open(prep["quarantine"]) as f:
        for line in f:
            if len(out) >= n:
                break
            r = json.loads(line)
            out.append({"source": r["source"], "row": r["row"], "reason": r["reason"]})
    return out


def stage_preflight(cfg: PipelineConfig, prep: dict, log=print) -> dict:
    from eagle3_pipeline.preflight import preflight

    return preflight(cfg, prep["tokens"], Path(prep["dir"]), log=log).model_dump()


def stage_gpu_gate(where: str, log=print) -> dict:
    from eagle3_pipeline.gpu import gpu_gate

    rec = gpu_gate(log=lambda m: log(f"[{where}] {m}")).model_dump()
    return {**rec, "where": where}


def _extract_location(cfg: PipelineConfig, prep: dict, pre: dict) -> tuple[str, Path]:
    key = extract_key(prep["version"], model_fingerprint(cfg.target.model, cfg.target.revision),
                      pre["layer_ids"], cfg.extract.storage_dtype,
                      f"{cfg.extract.connector_module}.{cfg.extract.connector_name}")
    return key, extract_dir(Path(prep["dir"]), cfg.target.model, key)


def stage_extract_plan(cfg: PipelineConfig, prep: dict, pre: dict) -> dict:
    """Where the extract version lives and how its shards are grouped (one engine child per group)."""
    import datasets

    from eagle3_pipeline.extract.shards import plan_shards

    key, out = _extract_location(cfg, prep, pre)
    rows = datasets.load_from_disk(prep["tokenized"]).num_rows
    shards = plan_shards(rows, cfg.extract.rows_per_shard)
    ids = [s.index for s in shards]
    per = cfg.extract.shards_per_group or max(1, len(ids))
    return {"content_key": key, "dir": str(out.resolve()), "rows": rows,
            "ranges": {str(s.index): [s.row_start, s.row_end] for s in shards},
            "groups": [ids[i:i + per] for i in range(0, len(ids), per)]}


def group_cache_key(plan: dict, shard_ids: list[int]) -> str:
    """Cache key of one shard group: the extract content key, its directory and the shard ids."""
    return content_key({"extract": plan["content_key"], "dir": plan["dir"], "shards": shard_ids,
                        "ranges": [plan["ranges"][str(k)] for k in shard_ids]})


def unpublished(plan: dict, shard_ids: list[int]) -> list[int]:
    """Shards of the group that the manifest does not list as published (all when there is none).
    Prefect's cache may only answer a group none of whose shards is here: a shard that verify
    marked failed, or a store that was wiped, makes its group run again."""
    from eagle3_pipeline.store import read_json

    man = read_json(Path(plan["dir"]) / "manifest.json", default={}) or {}
    done = {s["index"] for s in man.get("shards", []) if s["status"] == "published"
            and [s["row_start"], s["row_end"]] == plan["ranges"].get(str(s["index"]))}
    return [k for k in shard_ids if k not in done]


def stage_extract_group(cfg: PipelineConfig, prep: dict, plan: dict, shard_ids: list[int], force: bool = False,
                        log=print, on_shard=None) -> list[dict]:
    from eagle3_pipeline.extract.shards import extract_group

    recs = extract_group(cfg.extract, cfg.target, Path(prep["tokenized"]), Path(plan["dir"]), shard_ids, log=log,
                         force=force, content_key=plan["content_key"], on_shard=on_shard)
    return [r.model_dump(mode="json") for r in recs]


def stage_extract_summary(plan: dict) -> dict:
    from eagle3_pipeline.extract.shards import summarize

    return {**summarize(Path(plan["dir"])).model_dump(mode="json"), "content_key": plan["content_key"],
            "dir": plan["dir"]}


def stage_extract(cfg: PipelineConfig, prep: dict, pre: dict, log=print) -> dict:
    """The whole extract stage without Prefect: every group in turn (tests, `eagle3 extract`)."""
    plan = stage_extract_plan(cfg, prep, pre)
    for group in plan["groups"]:
        stage_extract_group(cfg, prep, plan, group, log=log)
    return stage_extract_summary(plan)


def stage_verify(cfg: PipelineConfig, prep: dict, pre: dict, ext: dict, log=print) -> dict:
    from eagle3_pipeline.verify.gate import check_verify_gate, verify

    res = verify(cfg.verify, cfg.target, Path(prep["tokenized"]), Path(ext["dir"]), pre["layer_ids"],
                 pre["dims"]["hidden_size"], cfg.extract.storage_dtype, cfg.extract.rows_per_shard,
                 ext["content_key"], log=log, extract_cfg=cfg.extract)
    check_verify_gate(res)
    return res.model_dump()


def stage_vocab(cfg: PipelineConfig, prep: dict, pre: dict, ext: dict, log=print) -> dict:
    from eagle3_pipeline.data.prepare import load_tokenizer
    from eagle3_pipeline.vocab import build_vocab

    tok = load_tokenizer(cfg.target)
    out = Path(ext["dir"]) / "vocab" / f"K{cfg.vocab.draft_vocab_size}"
    res = build_vocab(cfg.vocab, Path(prep["token_freq"]), pre["dims"]["vocab_size"], out,
                      special_token_ids=[t for t in (tok.eos_token_id,) if t is not None])
    return {**res.model_dump(mode="json"), "dir": str(out.resolve())}


# Train settings that change how a run is watched, not the draft it produces: a new value resumes
# the same checkpoint dir instead of training from scratch.
TRAIN_KEY_EXCLUDE = frozenset({"log_freq", "timeout_s", "num_workers"})


def train_key(cfg: PipelineConfig, ext: dict, voc: dict) -> str:
    return content_key({"extract": ext["content_key"], "vocab": voc["dir"],
                        "train": cfg.train.model_dump(exclude=set(TRAIN_KEY_EXCLUDE))})


def stage_train(cfg: PipelineConfig, prep: dict, pre: dict, ext: dict, voc: dict, log=print) -> dict:
    from eagle3_pipeline.train import train_draft
    from eagle3_pipeline.verify.gate import require_verified

    require_verified(Path(ext["dir"]), ext["content_key"])
    out = Path(ext["dir"]) / "train" / train_key(cfg, ext, voc)
    res = train_draft(cfg.train, cfg.target, Path(prep["tokenized"]), Path(ext["hidden_states_dir"]),
                      Path(voc["dir"]), pre["layer_ids"], out, log=log)
    return {**res.model_dump(mode="json"), "dir": str(out.resolve())}


def heldout_prompts(prep: dict, n: int) -> list[list[int]]:
    lines = Path(prep["heldout"]).read_text().splitlines()
    return [json.loads(line)["prompt_ids"] for line in lines[:n]]


def stage_evaluate(cfg: PipelineConfig, prep: dict, pre: dict, voc: dict, tr: dict, run_dir: Path, log=print) -> dict:
    from eagle3_pipeline.evaluate import check_acceptance_gate, evaluate_pair
    from eagle3_pipeline.train import make_untrained_draft

    prompts = heldout_prompts(prep, cfg.evaluate.num_prompts)
    if not prompts:
        raise RuntimeError(f"evaluate: no held-out prompts in {prep['heldout']} (prepare.heldout_rows is 0?)")
    untrained = None
    if cfg.evaluate.baseline:
        untrained = Path(tr["dir"]) / "untrained_draft"
        with dir_lock(Path(tr["dir"]), f"train dir {tr['dir']}", log):  # written once, never under a reader
            if not (untrained / "config.json").exists():
                make_untrained_draft(cfg.target, Path(voc["dir"]), pre["layer_ids"], untrained, cfg.train)
    rep = evaluate_pair(cfg.evaluate, cfg.target, Path(tr["checkpoint_best"]), untrained, prompts,
                        Path(run_dir) / "evaluate", log=log)
    check_acceptance_gate(rep, cfg.evaluate)
    return rep.model_dump(mode="json")
