"""Chaos: SIGKILL the extract stage at seeded random moments, then gate, resume and compare bytes.

Two kinds of kill, each in a fresh extract dir over the small run's tokenized data (tests/conftest.py
`small_reference`: ~24 rows, 6 shards of 4 rows, one engine child for all of them):
  engine child   the test process is the parent (stage_extract_group); a thread SIGKILLs the engine
                 child alone, as the OOM killer would; the parent must notice, record it and clean up;
  parent         a separate python process runs stage_extract_group and the test SIGKILLs its whole
                 process group, as a lost node or `kill -9` of the flow would; its engine child (own
                 session) is orphaned and must be ended by the gpu-gate.
Kill moments alternate between engine start-up (a random delay after the child appears, up to 60% of
the reference's start-up time, and at "engine ready" at the latest: a forked child can start far sooner than
the reference did) and extraction (a random delay after "engine ready" while the child
writes records; EAGLE3_TEST_RECORD_DELAY_S paces it so the kill lands mid-shard on any machine).
After each kill: no partial file under a final name (every hs_*.safetensors present holds the reference's
record: store.record_matches), every published shard hashes to the manifest, the gpu-gate leaves no
process of the trial alive, and a resume in this process publishes every shard with the same records
(byte for byte, or at rounding level: store.same_records) and the same manifest content as one clean
run, with no temporary or scratch file left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.extract.stage import ExtractFailed
from eagle3_pipeline.extract.worker import RECORD_DELAY_ENV
from tests.helpers.chaos import ENGINE_TRIALS, PARENT_TRIALS, DelayedKill, child_running, gate_after_kill, trial_rng
from tests.helpers.store import manifest_content, record_matches, same_records, scratch_left, sha256, temporaries

WORKER = "eagle3_pipeline.extract.worker"
RECORD_DELAY_S = 0.25
IGNORE = ("engine_in_process",)  # varied by the trials; does not change a byte of the records

pytestmark = pytest.mark.timeout(600)


def _kill_window(rng, ref, trial: int) -> tuple[str, float]:
    """(phase, delay after the phase's trigger): alternately during engine start-up and mid-extraction."""
    man = json.loads((ref.dir / "manifest.json").read_text())
    if trial % 2 == 0:
        return "init", rng.uniform(0.5, 0.6 * man["children"][0]["engine_start_s"])
    return "work", rng.uniform(0.0, 0.8 * man["num_rows"] * RECORD_DELAY_S)


def _watch(killer: DelayedKill, phase: str, line: str) -> None:
    """Start the kill's clock at its phase's line (the child's start, or "engine ready" for the work phase); an
    init-phase kill lands at "engine ready" at the latest."""
    if (phase == "init" and line.startswith("extract: child ")) or (phase == "work" and "engine ready" in line):
        killer.trigger.set()
    if phase == "init" and "engine ready" in line:
        killer.latest.set()


def _when(killer: DelayedKill) -> str:
    return " (at engine ready: this start was shorter than the drawn delay)" if killer.early else ""


def _check_after_kill(out: Path, ref) -> dict:
    """What a reader could see now: no partial record, published shards intact. Returns the manifest."""
    m = json.loads((out / "manifest.json").read_text())  # parses: it is only ever replaced whole
    hs = out / "hidden_states"
    for s in m["shards"]:
        if s["status"] == "published":
            for name, sha in s["files"].items():
                assert sha256(hs / name) == sha, f"shard {s['index']}: {name} does not hash to the manifest"
    for path in sorted(hs.glob("hs_*.safetensors")):  # published or not: complete files only
        record_matches(path, ref.dir / "hidden_states" / path.name)  # raises naming what differs
    return m


def _relocated(ref, out: Path):
    """The reference's ExtractVersion in the trial's own directory (same content key, same shard plan)."""
    return ref.version.model_copy(update={"dir": str(out.resolve()), "pool_dir": None})  # extracts for real


def _resume_and_compare(ref, out: Path) -> list[str]:
    from eagle3_pipeline.pipeline.stages import stage_extract_group

    lines: list[str] = []
    recs = stage_extract_group(ref.cfg, _relocated(ref, out), ref.version.groups[0], log=lines.append)
    assert [r.status for r in recs] == ["published"] * len(recs)
    same_records(out, ref.dir)
    assert manifest_content(out, IGNORE, file_hashes=False) == manifest_content(ref.dir, IGNORE, file_hashes=False)
    assert temporaries(out) == [] and scratch_left(out) == []
    return lines


@pytest.mark.parametrize("trial", range(ENGINE_TRIALS))
def test_engine_child_killed(trial, small_reference, tag, tmp_path, monkeypatch):
    from eagle3_pipeline.pipeline.stages import stage_extract_group

    ref = small_reference
    rng = trial_rng("engine", trial)
    phase, delay = _kill_window(rng, ref, trial)
    separate_core = trial % 4 == 2  # the production layout: vLLM's engine core in a process of its own
    cfg = ref.cfg.model_copy(update={"extract": ref.cfg.extract.model_copy(update={"engine_in_process": not separate_core})})
    out = tmp_path / "v"
    print(f"trial {trial}: SIGKILL the engine child {delay:.2f}s into {phase}"
          f"{' (separate engine-core process)' if separate_core else ''}")

    killer = DelayedKill(child_running(WORKER, tag), delay)
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        _watch(killer, phase, line)

    monkeypatch.setenv(RECORD_DELAY_ENV, str(RECORD_DELAY_S))
    try:
        with pytest.raises(ExtractFailed, match="code -9"):
            stage_extract_group(cfg, _relocated(ref, out), ref.version.groups[0], log=log)
    finally:
        killer.stop()
    monkeypatch.delenv(RECORD_DELAY_ENV)
    assert killer.killed is not None

    m = _check_after_kill(out, ref)
    published = [s["index"] for s in m["shards"] if s["status"] == "published"]
    print(f"trial {trial}: killed with shards {published} published{_when(killer)}")
    if phase == "init" and not any("engine ready" in line for line in lines):
        assert published == []  # killed before its engine was ready: nothing can be published (a loaded
        # machine may start the engine sooner than the reference's start-up the delay was drawn from)
    assert m["children"][-1]["status"] == "failed" and "code -9" in m["children"][-1]["error"]
    assert temporaries(out) == [] and scratch_left(out) == []  # the live parent cleaned up after its child
    gate_after_kill(tag)
    _resume_and_compare(ref, out)


PARENT = """
import sys
from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.pipeline.stages import stage_extract_group
cfg = load_config(sys.argv[1])
version = ExtractVersion.model_validate_json(open(sys.argv[2]).read())
stage_extract_group(cfg, version, version.groups[0], log=lambda m: print(m, flush=True))
print("DONE", flush=True)
"""


@pytest.mark.parametrize("trial", range(PARENT_TRIALS))
def test_parent_killed(trial, small_reference, tag, tmp_path):
    ref = small_reference
    rng = trial_rng("parent", trial)
    phase, delay = _kill_window(rng, ref, trial)
    out = tmp_path / "v"
    cfg_path, version_path = tmp_path / "cfg.yaml", tmp_path / "version.json"
    cfg_path.write_text(yaml.safe_dump(ref.cfg.model_dump(mode="json")))
    version_path.write_text(_relocated(ref, out).model_dump_json())
    print(f"trial {trial}: SIGKILL the parent's process group {delay:.2f}s into {phase}")

    proc = subprocess.Popen([sys.executable, "-u", "-c", PARENT, str(cfg_path), str(version_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, RECORD_DELAY_ENV: str(RECORD_DELAY_S)})
    killer = DelayedKill(lambda: proc.pid, delay, group=True)
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            _watch(killer, phase, line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=500)
    finally:
        killer.stop()
        proc.kill()
    reader.join(timeout=30)
    assert rc == -9 and "DONE" not in lines, "\n".join(lines[-30:])

    m = _check_after_kill(out, ref)
    published = [s["index"] for s in m["shards"] if s["status"] == "published"]
    assert m["children"][-1]["status"] == "running"  # nobody was left to close the attempt
    gate, before = gate_after_kill(tag)
    print(f"trial {trial}: killed with shards {published} published{_when(killer)}; processes of the trial alive "
          f"before the gate: {len(before)}; the gate ended {gate.killed}")
    resumed = _resume_and_compare(ref, out)
    assert any("was abandoned" in x for x in resumed), resumed
    m = json.loads((out / "manifest.json").read_text())
    assert m["children"][0]["status"] == "failed" and m["children"][0]["error"].startswith("abandoned")
