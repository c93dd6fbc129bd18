"""Window training (train.mode window): capture and training apart, the store holding a window of shards
(train/window.py), not the dataset (docs/decisions/capture-window.md). The train stage's entry in that mode
(pipeline/stages.py `entry`): capture (extract + verify per shard, published only when it passed) in a thread,
the trainer reading the window. More: docs/internals.md, "pipeline/window_training.py".
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.stage_spec import Log
from eagle3_pipeline.core.store import dir_lock, write_json
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.extract.stage import extract_group, group_deadline
from eagle3_pipeline.preflight.stage import record_bytes_per_token
from eagle3_pipeline.records.layout import ExtractVersion, Shard
from eagle3_pipeline.records.results import TrainResult, WindowRecord
from eagle3_pipeline.train.job import WindowSource
from eagle3_pipeline.train.stage import TrainInputs, train_draft, train_key, train_start
from eagle3_pipeline.train.window import ShardWindow, WindowStalled
from eagle3_pipeline.verify.stage import VerifyFailed, check_verify_gate, verify

VALIDATION_DIR, FAILED_DIR, WINDOW_DIR = "window-validation", "window-failed", "window"


def shard_key(shard: Shard) -> str:
    return f"shard-{shard.index:05d}"


def n_train_rows(rows: int, val_ratio: float) -> int:
    """speculators' train split, as the train worker computes it: the first int(rows x (1 - val_ratio)) rows."""
    return int(rows * (1 - val_ratio))


def window_layout(version: ExtractVersion, val_ratio: float) -> list[tuple[Shard, list[int]]]:
    """Every shard of the extraction with its train rows (those of the validation split are held apart), in
    capture order: the shards that hold validation rows first (the trainer validates at its epoch's end, and its
    rows are then all there), then the others in the extraction's order."""
    n = n_train_rows(version.rows, val_ratio)
    shards = [s for s in version.shards if s.row_end > n] + [s for s in version.shards if s.row_end <= n]
    return [(s, [r for r in range(s.row_start, s.row_end) if r < n]) for s in shards]


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def shard_version(version: ExtractVersion, d: Path) -> ExtractVersion:
    """`version` relocated to `d`: the extract stage writes one shard there, verify reads it there; no record pool
    (the pool would keep every record: the dataset, not a window)."""
    return version.model_copy(update={"dir": str(Path(d).resolve()), "pool_dir": None})


class Capture(threading.Thread):
    """The capture side, in its own thread: its result (per-shard verify results, bytes) or its error."""

    def __init__(self, cfg: PipelineConfig, version: ExtractVersion, window, out_dir: Path, log):
        super().__init__(name="window-capture", daemon=True)
        self.cfg, self.version, self.window, self.out_dir, self.log = cfg, version, window, out_dir, log
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.verified: list = []      # VerifyResult per shard, in order
        self.dataset_bytes = 0        # every shard's records and fingerprints as captured (what offline would store)
        self.validation_bytes = 0
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            for shard, rows in window_layout(self.version, self.cfg.train.val_ratio):
                if self.stop.is_set():
                    return
                self._capture(shard, rows)
            self.window.close()
        except BaseException as e:  # noqa: BLE001 - handed to the stage, which raises it
            self.error = e
            self.window.fail(f"{type(e).__name__}: {str(e)[:2000]}")
        finally:
            self.seconds = time.monotonic() - t0

    def _reserve(self, key: str, nbytes: int) -> None:
        """Room for `key`, waiting while the trainer holds the window (at most train.timeout_s, or until stopped)."""

        end = time.monotonic() + self.cfg.train.timeout_s
        while True:
            try:
                return self.window.reserve(key, nbytes, wait_s=5.0, poll_s=0.2)
            except WindowStalled:
                if self.stop.is_set() or time.monotonic() > end:
                    raise

    def _capture(self, shard: Shard, rows: list[int]) -> None:

        cfg, w, key = self.cfg, self.window, shard_key(shard)
        per = record_bytes_per_token(len(self.version.layer_ids), self.version.dims.hidden_size,
                                     self.version.storage_dtype)
        self._reserve(key, int(shard_tokens(self.version, shard) * per * 1.05))
        sv = shard_version(self.version, w.shard_dir(key))
        span = list(range(shard.row_start, shard.row_end))
        try:
            extract_group(cfg.extract, cfg.target, sv, [shard.index], log=self.log)
            self.dataset_bytes += dir_bytes(sv.hidden_states_dir) + dir_bytes(sv.fingerprints_dir)
            ver = verify(cfg.verify, cfg.target, sv, log=self.log, rows=span)
            self.verified.append(ver.model_copy(update={"mode": "window"}))
            try:
                check_verify_gate(ver)
            except VerifyFailed as e:
                aside = self.out_dir / FAILED_DIR / key
                shutil.rmtree(aside, ignore_errors=True)
                aside.parent.mkdir(parents=True, exist_ok=True)
                w.shard_dir(key).rename(aside)
                raise VerifyFailed(f"window shard {key} (extract shard {shard.index}, rows {shard.row_start}.."
                                   f"{shard.row_end - 1}) failed verify and was not published (moved to {aside}; "
                                   f"the trainer read nothing of it): {e}") from e
            self.validation_bytes += self._hold_validation(sv, [r for r in span if r not in set(rows)])
        except BaseException:
            w.abandon(key)
            raise
        if rows:
            w.publish(key, dir_bytes(w.shard_dir(key)))
            self.log(f"window: shard {key} verified and published ({len(rows)} train rows)")
        else:
            w.abandon(key)  # validation rows only: nothing for the trainer

    def _hold_validation(self, sv: ExtractVersion, val_rows: list[int]) -> int:
        """Move the verified records of the validation rows out of the shard, to the run's validation dir."""
        dest = self.out_dir / VALIDATION_DIR / "hidden_states"
        dest.mkdir(parents=True, exist_ok=True)
        moved = 0
        for r in val_rows:
            src = sv.record_path(r)
            moved += src.stat().st_size
            src.rename(dest / src.name)
        return moved


def shard_tokens(version: ExtractVersion, shard: Shard) -> int:

    lens = load_tokenized(version.tokenized_dir)["seq_len"]
    return int(sum(int(x) for x in lens[shard.row_start: shard.row_end]))


def trainer_wait_s(cfg: PipelineConfig) -> float:
    """How long the trainer waits for capture to publish a block (half the window): per shard one extract child's
    deadline and verify's two reference children."""

    per_shard = group_deadline(cfg.extract, 1) + 2 * cfg.verify.reference_timeout_s
    return per_shard * max(1, cfg.train.window_shards // 2)


def train_window(cfg: PipelineConfig, inputs: TrainInputs, log: Log = print) -> TrainResult:
    """train.mode window, the train stage's entry in that mode (pipeline/stages.py `entry`): capture (extract +
    verify per shard, publish) beside the trainer reading the window. The TrainResult carries `window` (the
    window's peak against the dataset's bytes, the shards) and its `verify` (every shard's gate, merged)."""
    version, voc = inputs.version, inputs.voc
    start, out_dir = train_start(cfg, version, log), version.train_dir(train_key(cfg, version))

    prev, tcfg = start
    t = cfg.train
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with dir_lock(out_dir / WINDOW_DIR, f"window training dir {out_dir}", log):
        # a window run does not resume (train/worker.py refuses it): a fresh window and validation dir
        shutil.rmtree(out_dir / VALIDATION_DIR, ignore_errors=True)
        shutil.rmtree(out_dir / WINDOW_DIR / "shards", ignore_errors=True)
        (out_dir / WINDOW_DIR / "window.json").unlink(missing_ok=True)
        w = ShardWindow(out_dir / WINDOW_DIR, t.window_shards, t.window_bytes, passes=tcfg.epochs)
        plan = [(shard_key(s), rows) for s, rows in window_layout(version, t.val_ratio) if rows]
        cap = Capture(cfg, version, w, out_dir, log)
        log(f"window: {len(version.shards)} shards captured in turn into a window of {t.window_shards} "
            f"({t.window_bytes or 'no'} byte limit), {len(plan)} with train rows, {tcfg.epochs} pass(es) over each "
            f"block of {max(1, t.window_shards // 2)}")
        cap.start()
        source = WindowSource(dir=str(w.dir), max_shards=t.window_shards, max_bytes=t.window_bytes,
                              passes=tcfg.epochs, plan=plan, wait_s=trainer_wait_s(cfg))
        val = version.model_copy(update={"dir": str((out_dir / VALIDATION_DIR).resolve()), "pool_dir": None})
        try:
            tr = train_draft(tcfg.model_copy(update={"epochs": 1}), cfg.target, val, Path(voc.dir), out_dir,
                             log=log, previous=prev, online=source)
        except BaseException:
            cap.stop.set()
            cap.join()
            if cap.error is not None:
                raise cap.error from None  # the cause (a shard that failed verify), not the trainer it stopped
            raise
        cap.join()
        if cap.error is not None:
            raise cap.error
    return _with_window(tr, cap, w.state(), version)


def _with_window(tr, cap: Capture, st, version: ExtractVersion):
    """The TrainResult with the window's record: its peak against the dataset's bytes, and the merged verify."""

    ver = merge_verify(cap.verified, version.content_key)
    window = WindowRecord(dir=str(Path(tr.dir) / WINDOW_DIR), max_shards=st.max_shards, max_bytes=st.max_bytes,
                          passes=st.passes, shards=len(version.shards), published=st.published,
                          released=st.released, peak_shards=st.peak_shards, peak_bytes=st.peak_bytes,
                          dataset_bytes=cap.dataset_bytes, validation_bytes=cap.validation_bytes,
                          capture_seconds=round(cap.seconds, 2), verify=ver.model_dump(mode="json"))
    write_json(Path(tr.dir) / WINDOW_DIR / "window_result.json", window.model_dump(mode="json"))
    return tr.model_copy(update={"window": window, "hidden_states_peak_bytes": st.peak_bytes + cap.validation_bytes})


def merge_verify(results: list, content_key: str):
    """One VerifyResult for the report from every shard's (each passed, or the stage raised): per check, counts
    and seconds summed, samples joined, the worst error or margin kept (min_* the least), a mean the shards'
    mean; the run's problems, bad rows and counts summed."""
    if not results:
        raise ValueError("window: no shard was verified")
    base = results[0]
    checks = {name: _merge_check([r.checks[name] for r in results]) for name, _ in base.checks.items()}
    return base.model_copy(update={
        "content_key": content_key, "mode": "window", "passed": all(r.passed for r in results),
        "checks": base.checks.model_copy(update=checks),
        "problems": [p for r in results for p in r.problems], "bad_rows": [b for r in results for b in r.bad_rows],
        "rows_rechecked": sum(r.rows_rechecked for r in results),
        "shards_rechecked": sum(r.shards_rechecked for r in results),
        "seconds": round(sum(r.seconds or 0.0 for r in results), 2)})


def _merge_check(parts: list):
    """One check's results over the shards, field by field (see merge_verify)."""
    first, merged = parts[0], {}
    for name in type(first).model_fields:
        vals = [getattr(p, name) for p in parts]
        known = [v for v in vals if v is not None]
        if name == "ran":
            merged[name] = any(vals)
        elif name == "layer_stats":  # per layer, learned from the shard's files: the first shard's stand
            merged[name] = vals[0]
        elif isinstance(vals[0], bool) or isinstance(vals[0], (dict, str)) or not known:
            merged[name] = vals[0]
        elif isinstance(known[0], list):
            merged[name] = [x for v in known for x in v]
        elif isinstance(known[0], int) or name.endswith("seconds"):
            merged[name] = sum(known) if name != "peak_rss_bytes" else max(known)
        elif name.startswith("min_"):
            merged[name] = min(known)
        elif name.startswith(("mean_", "median_")):
            merged[name] = sum(known) / len(known)
        else:  # max_*, margins, spreads, deviations: the worst
            merged[name] = max(known)
    return first.model_copy(update=merged)
