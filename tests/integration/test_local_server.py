"""flows/local_server.py: Prefect's temporary server started before a command's imports and handed to
Prefect. Each case runs in a child process of its own (Prefect's server singleton is per process) on a
fresh PREFECT_HOME without an API URL, as `eagle3 run` on a new machine; real servers, real API calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from flows.local_server import STARTUP_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, os, sys
    from flows.local_server import EarlyServer
    case = sys.argv[1]
    early = EarlyServer.start()
    out = {"early": early is not None}
    import flows.pipeline  # what `eagle3 run` imports meanwhile (and Prefect's logging set-up with it)
    if early is not None:
        out["early_pid"] = early.proc.pid
        if case == "died":
            early.proc.kill(); early.proc.wait()
        out["adopted"] = early.adopt()
    from prefect.client.orchestration import get_client
    from prefect.server.api.server import SubprocessASGIServer
    with get_client(sync_client=True) as client:
        out["api_url"] = str(client.api_url)
        out["limits"] = len(client.read_global_concurrency_limits(limit=10, offset=0))  # a real API call
    server = SubprocessASGIServer()
    out["server_pid"] = server.server_process.pid if server.server_process else None
    print("RESULT " + json.dumps(out), flush=True)
""")


def _child(case: str, tmp_path: Path, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    # the start-up wait `eagle3 run` sets: at Prefect's 20 s default, Prefect's own server timed out on a loaded
    # CI machine after the early one died (stop 59)
    env.update(PREFECT_HOME=str(tmp_path / f"prefect-{case}"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=STARTUP_TIMEOUT_S, PYTHONPATH=str(ROOT),
               **env_extra)
    p = subprocess.run([sys.executable, "-c", CHILD, case], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[7:]), "log": p.stdout + p.stderr}


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.time() + within_s
    while time.time() < end:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def test_early_server_is_prefects_temporary_server_and_ends_with_the_command(tmp_path):
    r = _child("adopt", tmp_path)
    assert r["early"] and r["adopted"], r["log"][-2000:]
    assert r["server_pid"] == r["early_pid"]  # Prefect uses ours and started none of its own
    assert r["log"].count("Started temporary server on") == 1
    assert "Starting temporary server" not in r["log"]
    assert r["limits"] >= 0
    assert _gone(r["early_pid"]), "the adopted server outlived its command"


def test_a_dead_early_server_leaves_the_start_to_prefect(tmp_path):
    r = _child("died", tmp_path)
    assert r["early"] and not r["adopted"]
    assert "the temporary server started early is not used" in r["log"]
    assert "Starting temporary server" in r["log"]  # Prefect's own start, as without the early one
    assert r["server_pid"] and r["server_pid"] != r["early_pid"]
    assert _gone(r["server_pid"])


def test_nothing_starts_early_with_an_api_url(tmp_path):
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens there: no API call is made
    code = "from flows.local_server import EarlyServer; print('EARLY', EarlyServer.start())"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PREFECT_HOME": str(tmp_path / "p"), "PYTHONPATH": str(ROOT), **env})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "EARLY None" in p.stdout
