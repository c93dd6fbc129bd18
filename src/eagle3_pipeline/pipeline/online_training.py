"""Online training (train.mode online): the verify gate on rows from a vLLM server of the target, then the trainer
reading every row from the same server (docs/internals.md, "pipeline/online_training.py").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle3_pipeline.checks.final_layer import FP8_SLACK
from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.stage_spec import Log
from eagle3_pipeline.core.store import dir_lock, write_json
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.preflight.stage import disk_plans
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.results import OnlineRecord, OnlineResult, TrainResult
from eagle3_pipeline.train.job import OnlineSource, RowChecksSpec
from eagle3_pipeline.train.online import HiddenStateServer, take_sample
from eagle3_pipeline.train.stage import TrainInputs, train_draft, train_key, train_start
from eagle3_pipeline.verify.reference import reference_check
from eagle3_pipeline.verify.stage import VerifyFailed, check_verify_gate, verify


def train_online(cfg: PipelineConfig, inputs: TrainInputs, log: Log = print) -> TrainResult:
    """train.mode online, the train stage's entry in that mode (pipeline/stages.py `entry`): start a vLLM server
    of the target (extract's engine settings, layers and connector), run the verify gate on `verify.online_rows`
    rows taken from it, then train with every row's hidden states fetched from it (train/online.py); the server
    ends with the stage. The TrainResult carries the OnlineResult and its `verify` (the VerifyResult of the
    sample) for the report."""
    version = inputs.version
    work = online_work_dir(cfg, version)
    with dir_lock(work, f"online training dir {work}", log), online_server(cfg, version, work, log) as srv:
        return train_on_server(cfg, inputs, srv, log)


def online_work_dir(cfg: PipelineConfig, version: ExtractVersion) -> Path:
    """The online run's own dir (its server's scratch and log, the sample, the row checks): in the train dir."""
    return version.train_dir(train_key(cfg, version)) / "online"


def online_server(cfg: PipelineConfig, version: ExtractVersion, work: Path, log: Log = print) -> HiddenStateServer:
    """The server `train_online` starts (a context manager: `with online_server(...) as srv`): the target with
    extract's engine settings, connector and layers, rows up to the longest tokenized row."""
    max_len = int(max(load_tokenized(version.tokenized_dir)["seq_len"])) + 1
    return HiddenStateServer(cfg.extract, cfg.target, version, work, max_model_len=max_len,
                             start_timeout_s=cfg.train.online_start_timeout_s, log=log)


def train_on_server(cfg: PipelineConfig, inputs: TrainInputs, srv: HiddenStateServer, log: Log = print) -> TrainResult:
    """Everything `train_online` does with its running server `srv` (one `online_server(cfg, ...)` of the same
    version, in `online_work_dir`): the verify gate on its sample, then training from it. A server stays usable
    after a failed run (tests ask one server again with another corruption)."""
    version, voc = inputs.version, inputs.voc
    prev, tcfg = train_start(cfg, version, log)  # the previous draft to continue from (or None), the settings for it
    out_dir = version.train_dir(train_key(cfg, version))
    work = srv.work_dir
    seq_lens = load_tokenized(version.tokenized_dir)["seq_len"]
    offline_bytes = disk_plans(cfg, len(version.layer_ids), version.dims.hidden_size, int(sum(seq_lens)))["offline bf16"]
    sample = take_sample(srv, cfg, version, work, log=log)
    ver = verify(cfg.verify, srv.target, sample.version, log=log, rows=sample.rows, fingerprints=True)
    ver = ver.model_copy(update={"mode": "online"})
    write_json(sample.version.verify_path, ver.model_dump(mode="json"))
    check_verify_gate(ver)
    rows, tokens, seconds, nbytes = sample.rows, sample.tokens, sample.seconds, sample.bytes
    checks = online_row_checks(cfg, srv.target, version, ver, work)
    try:
        source = OnlineSource(endpoint=srv.endpoint, model=srv.model,
                              request_timeout_s=cfg.train.online_request_timeout_s,
                              max_in_flight=max(1, min(cfg.extract.max_num_seqs, 16)),
                              hidden_size=version.dims.hidden_size, checks=checks)
        tr = train_draft(tcfg, cfg.target, version, Path(voc.dir), out_dir, log=log, previous=prev, online=source)
    except Exception as e:
        rejected = _jsonl_rows(checks and checks.rejected_path, "rejected")
        if rejected:
            raise VerifyFailed(f"online training stopped: {len(rejected)} rows from the server failed the "
                               "per-row checks against the target on every attempt:\n  "
                               + "\n  ".join(rejected[r] for r in sorted(rejected)[:20])) from e
        raise
    row_checks = confirm_online_flags(cfg, srv.target, version, checks, log)
    peak = srv.scratch_peak()
    res = OnlineResult(endpoint=srv.endpoint, server_start_s=srv.start_s, sample_rows=rows, sample_tokens=tokens,
                       sample_seconds=seconds, sample_bytes=nbytes, scratch_peak_bytes=peak,
                       hidden_states_peak_bytes=peak + nbytes, offline_bytes_estimate=offline_bytes,
                       work_dir=str(work.resolve()))
    write_json(work / "online.json", res.model_dump(mode="json"))
    log(f"online: hidden states on disk peaked at {res.hidden_states_peak_bytes / 1e6:.1f} MB ({nbytes / 1e6:.1f} MB "
        f"verified sample + {peak / 1e6:.2f} MB in flight); the stored dataset would take {offline_bytes / 1e6:.0f} MB")
    online = OnlineRecord(**res.model_dump(), verify=ver.model_dump(mode="json"), row_checks=row_checks)
    return tr.model_copy(update={"hidden_states_peak_bytes": res.hidden_states_peak_bytes, "online": online,
                                 "engine_start_s": round((tr.engine_start_s or 0.0) + srv.start_s, 2)})


def online_row_checks(cfg: PipelineConfig, target, version: ExtractVersion, ver, work: Path):
    """What the online trainer judges every row by (train/job.py RowChecksSpec): the target's final
    norm and lm_head against the fingerprint each response carries, and the layer profiles the verify gate
    learned from the sample (`ver`), each on or off by itself: the fingerprint where it ran on the sample, the
    state sketch unless verify.allow_skip names it. None only when every one is skipped by name: then rows get
    their structure checked only, as the report's checks say. Clears the files of an
    earlier attempt (every epoch asks the server for every row again)."""
    fp, sk, profile = ver.checks.fingerprint, ver.checks.state_sketch, ver.checks.identity.profile
    fingerprint, sketch = fp.ran, "state_sketch" not in cfg.verify.allow_skip or sk.ran
    if not (fingerprint or sketch or profile):
        return None  # every per-row check is skipped by name (verify.allow_skip); the sample's gate said so
    d = work / "row_checks"
    shutil.rmtree(d, ignore_errors=True)
    (d / "flagged" / "hidden_states").mkdir(parents=True)
    return RowChecksSpec(
        model_dir=str(Path(target.model).resolve()), norm_eps=version.dims.norm_eps, atol=cfg.verify.fingerprint_atol,
        rtol=cfg.verify.fingerprint_rtol, stol=cfg.verify.fingerprint_stol,
        slack=FP8_SLACK if version.storage_dtype == "fp8" else 1.0, layer_ids=list(version.layer_ids),
        storage_dtype=version.storage_dtype, identity=profile, fingerprint=fingerprint, sketch=sketch,
        rejected_path=str(d / "rejected.jsonl"),
        flagged_path=str(d / "flagged.jsonl"), flagged_dir=str(d / "flagged" / "hidden_states"))


def _jsonl_rows(path: str | None, kind: str) -> dict[int, str]:
    """{row: why} of the lines of `kind` in a row-checks file (the last line of a row wins)."""
    if not path or not Path(path).is_file():
        return {}
    last = {}
    for line in Path(path).read_text().splitlines():
        ev = json.loads(line)
        last[int(ev["row"])] = ev
    return {row: ev["why"] for row, ev in last.items() if ev.get("kind") == kind}


def confirm_online_flags(cfg: PipelineConfig, target, version: ExtractVersion, checks, log) -> dict:
    """After online training: rows the layer profiles flagged (kept out of training) are recomputed with the
    target itself (the streamed reference, verify.confirm_rows of them); a row the model disagrees with, or
    one left unconfirmed, fails the gate (exit 4), one it agrees with is cleared. Returns what the train
    record keeps: how every row was judged."""
    if checks is None:
        return {"fingerprint": False, "state_sketch": False, "identity": False, "flagged": [], "cleared": [],
                "unavailable": []}
    flagged = _jsonl_rows(checks.flagged_path, "flagged")
    unavailable = _jsonl_rows(checks.rejected_path, "unavailable")
    out = {"fingerprint": checks.fingerprint, "state_sketch": checks.sketch, "identity": checks.identity is not None,
           "flagged": sorted(flagged), "cleared": [], "unavailable": sorted(unavailable)}
    for name in ("fingerprint", "state_sketch", "identity"):
        log(f"online: per-row check {name}: " + ("every row" if out[name] else "skipped (verify.allow_skip names it, "
                                                                               "or the sample's gate could not run it)"))
    if unavailable:
        log(f"online: {len(unavailable)} rows could not be fetched from the server and were not trained on: "
            f"{sorted(unavailable)[:20]} ({checks.rejected_path})")
    if not flagged:
        ran = [n for n in ("fingerprint", "state_sketch", "identity") if out[n]]
        log(f"online: every row the trainer read passed the per-row checks (structure, {', '.join(ran) or 'no other'})")
        return out
    rows = sorted(flagged)[: cfg.verify.confirm_rows]
    fv = version.model_copy(update={"dir": str(Path(checks.flagged_dir).parent), "pool_dir": None})
    ref = reference_check(target, fv, rows, log=log, cfg=cfg.verify)
    bad = set(sorted(flagged)[cfg.verify.confirm_rows:]) | (set(rows) if ref.skipped else set(ref.bad_rows))
    out["cleared"] = [r for r in rows if r not in bad]
    if bad:
        why = ref.skipped or "; ".join(ref.problems[:5])
        raise VerifyFailed(f"online training: {len(bad)} of {len(flagged)} rows the layer profiles flagged are not "
                           f"cleared by the target ({why}):\n  " + "\n  ".join(flagged[r] for r in sorted(bad)[:20]))
    log(f"online: {len(flagged)} rows flagged by the layer profiles were recomputed with the target and cleared "
        f"(kept out of this training): {out['cleared']}")
    return out
