"""tests/helpers/server.node_processes: what the control plane's tests kill as "a lost node" is the node's tree and
every process one of its members launched through a fork server (named by our launcher variable), not a stranger's."""

import os
import subprocess
import sys
import time

import psutil

from eagle3_pipeline.core.proc import LAUNCHER_ENV
from tests.helpers.server import node_processes

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_node_is_its_tree_and_what_it_launched_elsewhere():
    node = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    launched = subprocess.Popen(SLEEP, env={**os.environ, LAUNCHER_ENV: str(node.pid)}, start_new_session=True)
    stranger = subprocess.Popen(SLEEP, env={**os.environ, LAUNCHER_ENV: str(os.getpid())}, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(node.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(node.pid).children()
        assert {p.pid for p in node_processes(node.pid)} == {node.pid, child.pid, launched.pid}
    finally:
        for p in psutil.Process(node.pid).children() + [psutil.Process(x.pid) for x in (node, launched, stranger)]:
            p.kill()
        for p in (node, launched, stranger):
            p.wait()
