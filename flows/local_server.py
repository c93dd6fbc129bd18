"""Prefect's temporary server, started when a flow command starts instead of when its flow does.

More: docs/internals.md, "flows/local_server.py".
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import random
import socket
import subprocess
import sys
import time

PORTS = range(8000, 9000)  # where Prefect's temporary servers listen
PORT_TAKEN = 3  # uvicorn's exit code when its port is taken
# how long a command waits for its temporary server (Prefect's default, 20 s, was too short on a loaded
# 2-core machine: "Timed out while attempting to connect to ephemeral Prefect API server")
STARTUP_TIMEOUT_S = "180"


def _die_with(parent: int):
    """A preexec_fn: the server gets SIGTERM when the command that started it dies, even by SIGKILL (the OOM
    killer, a closed terminal), so no temporary server outlives its command (Linux PR_SET_PDEATHSIG)."""
    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the command died before the call: nobody would send the signal
            os._exit(1)
    return preexec


def _free_port() -> int:
    for _ in range(20):
        port = random.choice(PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {PORTS}")


class EarlyServer:
    def __init__(self, proc: subprocess.Popen, port: int, argv: list[str], env: dict[str, str]):
        self.proc, self.port, self._argv, self._env = proc, port, argv, env
        self.adopted = False
        atexit.register(self._end)

    @classmethod
    def start(cls) -> EarlyServer | None:
        """Start the temporary server's process now; None when an API URL is configured (or temporary
        servers are not allowed: Prefect raises its own error then)."""
        try:
            import prefect  # noqa: PLC0415  heavy: prefect (the CLI imports this module)
            from prefect.settings import get_current_settings  # noqa: PLC0415  heavy: prefect (the CLI imports this module)

            settings = get_current_settings()
            if settings.api.url or not settings.server.ephemeral.enabled:
                return None
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **settings.to_environment_variables(exclude_unset=True)}
            port = _free_port()
            argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                    "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--log-level", "error",
                    "--lifespan", "on"]
            return cls(cls._spawn(argv, env, port), port, argv, env)
        except Exception as e:  # noqa: BLE001 - Prefect starts its own, as without this
            _log().debug(f"no early temporary server: {type(e).__name__}: {e}")
            return None

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], port: int) -> subprocess.Popen:
        return subprocess.Popen([*argv, "--port", str(port)], env=env, preexec_fn=_die_with(os.getpid()))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def adopt(self) -> bool:
        """Wait until the server answers, then make it Prefect's temporary server of this process.
        Returns whether it did; otherwise the server is ended and Prefect will start its own."""
        try:
            import httpx  # noqa: PLC0415  heavy: prefect (the CLI imports this module)
            from prefect.server.api.server import SubprocessASGIServer, subprocess_server_logger  # noqa: PLC0415  heavy: prefect (the CLI imports this module)
            from prefect.settings import get_current_settings  # noqa: PLC0415  heavy: prefect (the CLI imports this module)

            limit = time.monotonic() + get_current_settings().server.ephemeral.startup_timeout_seconds
            with httpx.Client() as client:
                while True:
                    if self.proc.poll() == PORT_TAKEN:  # taken since we looked: another port, as Prefect does
                        self.port = _free_port()
                        self.proc = self._spawn(self._argv, self._env, self.port)
                    elif self.proc.poll() is not None:
                        raise RuntimeError(f"the server process exited with code {self.proc.returncode}")
                    try:
                        if client.get(f"{self.url}/api/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > limit:
                        raise TimeoutError(f"no answer from {self.url} in time")
                    time.sleep(0.1)
            server = SubprocessASGIServer()
            if server.running:  # Prefect started one already: it is the one in use
                raise RuntimeError(f"Prefect's own temporary server runs already ({server.address})")
            server.port, server.server_process, server.running = self.port, self.proc, True
            atexit.register(server.stop)
            self.adopted = True
            subprocess_server_logger.info(f"Started temporary server on {server.address} (with this command's "
                                          "imports)")
            return True
        except Exception as e:  # noqa: BLE001
            _log().warning(f"the temporary server started early is not used ({type(e).__name__}: {e}); "
                           "Prefect starts its own")
            self._end()
            return False

    def _end(self) -> None:
        if self.adopted or self.proc.poll() is not None:
            return  # Prefect stops an adopted one (SubprocessASGIServer.stop, at exit)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _log() -> logging.Logger:
    return logging.getLogger("eagle3.local_server")
