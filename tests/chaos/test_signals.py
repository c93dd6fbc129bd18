"""SIGTERM and SIGINT to `eagle3 run` and `eagle3 extract` mid-extraction: a clean shutdown.

Each signalled command runs the small run (tests/helpers/store.small_overrides: ~24 rows in 6 shards
of 4, one engine child) on one store, with EAGLE3_TEST_RECORD_DELAY_S pacing the engine child so
that extraction takes a few seconds per shard on any machine. The signal is sent, to the command's
pid only (`kill -TERM <pid>`, `kill -INT <pid>`), once the manifest shows a shard published that was
not published before; the process tree is walked with psutil just before it. After the command
exits: its exit code is 128 + the signal (docs/operations.md, "Exit codes"), every process of that tree is gone
(the engine child and its workers, Prefect's temporary server `uvicorn ... prefect.server.api.server`
that `eagle3 run` starts without PREFECT_API_URL) and so is every process carrying the test's
environment tag (wherever it was re-parented), and no lock file of the store is held. The next
command on the same store resumes: shards published before are reused (same attempt count, same
bytes), and a final `eagle3 extract` publishes the rest.

`eagle3 run` is signalled twice (SIGTERM, then SIGINT on the re-run, which must first reuse what
the first one published); `eagle3 extract` once (SIGTERM). Four engine starts in all.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.chaos import TAG_ENV
from tests.helpers.store import processes_with_env, small_overrides

ROOT = Path(__file__).resolve().parents[2]
EAGLE3 = Path(sys.executable).parent / "eagle3"
RECORD_DELAY_S = 0.5

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def signal_store(tiny_target, tmp_path_factory):
    """One store and one PREFECT_HOME (the temporary server's SQLite DB) for every command here."""
    root = tmp_path_factory.mktemp("signals")
    return root, small_overrides(tiny_target, root / "store")


def _env(root: Path, tag: str) -> dict:
    """No PREFECT_API_URL: `eagle3 run` starts Prefect's temporary server, as on a fresh machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root / "prefect-home"), PREFECT_LOCAL_STORAGE_PATH=str(root / "prefect-home" / "storage"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               EAGLE3_TEST_RECORD_DELAY_S=str(RECORD_DELAY_S), **{TAG_ENV: tag})
    return env


def _command(kind: str, root: Path, overrides: list[str]) -> list[str]:
    argv = [str(EAGLE3), kind, "--config", str(ROOT / "configs" / "tiny-cpu.yaml")]
    if kind == "run":
        argv += ["--output-dir", str(root / "runs")]
    for ov in overrides:
        argv += ["--set", ov]
    return argv


def _manifest(store: Path) -> dict | None:
    found = sorted(store.rglob("manifest.json"))
    return json.loads(found[0].read_text()) if found else None  # replaced atomically: always whole


def _published(m: dict | None) -> dict[int, int]:
    """{shard index: attempts} of the published shards."""
    return {s["index"]: s["attempts"] for s in (m or {}).get("shards", []) if s["status"] == "published"}


def _tree(pid: int, tag: str) -> dict[int, tuple[float, str]]:
    """pid -> (create time, command line) of the process, all its descendants and every other process with the
    test's tag (a worker child forked by a fork server is no descendant of the command that asked for it)."""
    import psutil

    out = {}
    descendants = [c.pid for c in psutil.Process(pid).children(recursive=True)]
    for member in dict.fromkeys([pid, *descendants, *processes_with_env(TAG_ENV, tag)]):
        try:
            p = psutil.Process(member)
            out[member] = (p.create_time(), " ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out


def _survivors(tree: dict[int, tuple[float, str]]) -> list[str]:
    import psutil

    alive = []
    for pid, (created, cmd) in tree.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {cmd[:200]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _held_locks(store: Path) -> list[Path]:
    held = []
    for path in store.rglob("*.lock"):
        with open(path, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(path)
            else:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return held


def _default_sigint() -> None:
    """A command started from a background job (`nohup make test &`) inherits SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler: SIGINT would do nothing. Give the child the
    default disposition a terminal user's command has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_mid_extraction(kind: str, sig: int, root: Path, overrides: list[str], tag: str) -> dict:
    """Start `eagle3 <kind>`, wait for a newly published shard, walk the tree, send `sig` to the
    command, and check the shutdown. Returns {before, after: published shards, output}."""
    store = root / "store"
    before = _published(_manifest(store))
    log = root / f"{kind}-{signal.Signals(sig).name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_command(kind, root, overrides), cwd=ROOT, env=_env(root, tag), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_sigint)
    try:
        while True:
            assert proc.poll() is None, f"eagle3 {kind} exited ({proc.returncode}) before a new shard was published:\n" \
                                        + log.read_text(errors="replace")[-4000:]
            now = _published(_manifest(store))
            if set(now) - set(before):
                break
            time.sleep(0.1)
        tree = _tree(proc.pid, tag)
        proc.send_signal(sig)
        t_sig = time.time()
        rc = proc.wait(timeout=300)
        stop_s = time.time() - t_sig
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text(errors="replace")
    cmds = [c for _, c in tree.values()]
    assert any("eagle3_pipeline.extract.worker" in c for c in cmds), cmds  # the engine child was running
    if kind == "run":
        assert any("prefect.server.api.server" in c for c in cmds), cmds  # and Prefect's temporary server
    assert rc == 128 + sig, f"eagle3 {kind}: exit code {rc}, expected {128 + sig}\n{output[-4000:]}"
    assert f"eagle3 {kind}: error {128 + sig}" in output, output[-4000:]
    survivors = _survivors(tree)
    assert survivors == [], f"processes of `eagle3 {kind}` outlived it:\n" + "\n".join(survivors)
    tagged = processes_with_env(TAG_ENV, tag)
    assert tagged == [], f"processes with the test's tag outlived `eagle3 {kind}`: {tagged}"
    assert _held_locks(store) == []
    after = _published(_manifest(store))
    assert {k: after[k] for k in before} == before, "a shard published before was extracted again"
    assert len(after) > len(before)
    print(f"eagle3 {kind}, {signal.Signals(sig).name}: exit {rc} {stop_s:.1f}s after the signal, {len(tree)} processes ended, "
          f"shards published {sorted(before)} -> {sorted(after)}")
    return {"before": before, "after": after, "output": output}


def test_sigterm_then_sigint_to_eagle3_run(signal_store, tag):
    root, overrides = signal_store
    signal_mid_extraction("run", signal.SIGTERM, root, overrides, tag)
    second = signal_mid_extraction("run", signal.SIGINT, root, overrides, tag)  # a re-run: resumes, then stopped
    assert second["before"], "the SIGTERM run published nothing to resume from"


def test_sigterm_to_eagle3_extract_then_resume(signal_store, tag):
    root, overrides = signal_store
    stopped = signal_mid_extraction("extract", signal.SIGTERM, root, overrides, tag)
    env = {**_env(root, tag), "EAGLE3_TEST_RECORD_DELAY_S": "0"}
    r = subprocess.run(_command("extract", root, overrides), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = _manifest(root / "store")
    final = _published(m)
    assert len(final) == len(m["shards"])  # everything published now
    assert {k: final[k] for k in stopped["after"]} == stopped["after"]  # the stopped run's shards were reused
    assert processes_with_env(TAG_ENV, tag) == []


def test_kill_9_of_eagle3_run_leaves_no_process(signal_store, tiny_target, tmp_path, tag):
    """`kill -9` of `eagle3 run` mid-extraction (the OOM killer, a hard-closed terminal): nothing it started
    outlives it: Prefect's temporary server ends by its parent-death signal, the engine child and its workers
    by theirs, within seconds; the next command resumes as after any crash (test_sigterm_* above). A store of
    its own: the module's store is fully extracted by the tests before it. The module's PREFECT_HOME: its
    database is migrated already (the first run of test_sigterm_then_sigint_to_eagle3_run started on a fresh one)."""
    root, overrides = tmp_path, small_overrides(tiny_target, tmp_path / "store")
    store = root / "store"
    before = _published(_manifest(store))
    log = root / "run-KILL.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_command("run", root, overrides), cwd=ROOT, env=_env(signal_store[0], tag), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            if set(_published(_manifest(store))) - set(before):
                break
            time.sleep(0.1)
        tree = _tree(proc.pid, tag)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    cmds = [c for _, c in tree.values()]
    assert any("prefect.server.api.server" in c for c in cmds), cmds
    deadline = time.time() + 30
    while (left := _survivors(tree)) and time.time() < deadline:
        time.sleep(0.5)
    assert left == [], "processes of `eagle3 run` outlived its kill -9 by 30 s:\n" + "\n".join(left)
    assert processes_with_env(TAG_ENV, tag) == []
