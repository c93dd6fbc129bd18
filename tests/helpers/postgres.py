"""A throwaway PostgreSQL cluster for tests that run a Prefect server on the database production uses
(tests/chaos/test_control_plane.py; infra/docker-compose.yml runs the same server on postgres:16).

Debian's `postgresql` package (`make postgres` installs it): initdb into a fresh directory, the server
on 127.0.0.1 and a free port, trust authentication, fsync off (a test cluster, thrown away). Root may
not run postgres, so as root every command runs as the `postgres` user (runuser) on a directory it owns.
`stop()` / `start()` take the database away and bring it back with its data (the 30-second outage test).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from eagle3_pipeline.core.ports import free_port


def pg_bin() -> Path | None:
    """The directory of initdb/pg_ctl (Debian keeps them out of PATH), or None when not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresCluster:
    """One cluster, one database `prefect` owned by user `prefect`."""

    def __init__(self, bin_dir: Path, port: int | None = None):
        self.bin = bin_dir
        self.port = port or free_port()
        self.as_root = os.geteuid() == 0
        # under /tmp itself: pytest's tmp dirs are 0700 root, which the postgres user cannot enter
        self.root = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
        self.data, self.log = self.root / "data", self.root / "postgres.log"
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self.url = f"postgresql+asyncpg://prefect@127.0.0.1:{self.port}/prefect"

    def _run(self, *args: str, timeout: float = 120) -> str:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}\n"
                               + self.tail())
        return r.stdout

    def tail(self, n: int = 30) -> str:
        try:
            return "--- postgres log ---\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def init(self) -> PostgresCluster:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        self.start()
        self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-v", "ON_ERROR_STOP=1",
                  "-c", "CREATE ROLE prefect LOGIN", "-c", "CREATE DATABASE prefect OWNER prefect")
        return self

    def start(self) -> None:
        opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                f"-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start")

    def stop(self) -> None:
        """Stop at once (`-m fast`: open connections are closed, as when the database host goes away)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def ready(self) -> bool:
        r = subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                           capture_output=True)
        return r.returncode == 0

    def destroy(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop")
        except RuntimeError:
            pass
        for _ in range(20):
            try:
                shutil.rmtree(self.root)
                return
            except OSError:
                time.sleep(0.5)
