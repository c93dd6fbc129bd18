"""Children started by a fork of a process that has made their imports once (a fork server), not a new interpreter.

Off unless EAGLE3_FORK_SERVER names a directory: the test suite turns it on (a vLLM or speculators import is ~6 CPU s,
paid by hundreds of short-lived children); a GPU node never needs it. Owns `start(argv, env)` (a ForkedChild, or
None: spawn it) and the server's loop. A server serves one import-time environment (`signature`); docs/decisions/
fork-server.md has what a forked child shares with its server and what it cannot have.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import fcntl
import hashlib
import importlib
import importlib.machinery
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import psutil

from eagle3_pipeline.core import heap

ENV = "EAGLE3_FORK_SERVER"
OWNER_FILE = "owner"  # the pid whose end ends every server of the directory
IDLE_S = 300.0  # a server with no child running that forked nothing for this long ends
START_S = 120.0  # a server's imports are done within this, or its children are spawned
# what the environment may hold differently from the server's: read by a child at run time, never at import
RUN_TIME = ("EAGLE3_", "PREFECT_", "PYTEST_", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "TQDM_DISABLE", "COV_", "_",
            # vLLM's, read when an engine starts (vllm.envs reads lazily; no module reads these at import)
            "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS", "VLLM_USE_V2_MODEL_RUNNER",
            # read by an engine's build only (vllm/v1/engine/llm_engine.py): an in-process engine child (0) and an
            # online server (unset) share a server
            "VLLM_ENABLE_V1_MULTIPROCESSING")
# the import path a child rebuilds for itself (_child): `python -m` puts its directory first, then these entries
IMPORT_PATH = ("PYTHONPATH",)
# what importing vLLM (and OpenCV, which it imports) sets in os.environ: a starter that imported vLLM passes them on,
# one that did not does not; not compared, a child gets its starter's value, else the one the server's imports set
IMPORT_MADE = ("AITER_SITUV2_A4W4", "LD_LIBRARY_PATH", "PYTORCH_NVML_BASED_CUDA_CHECK", "TILELANG_CLEANUP_TEMP_FILES",
               "TORCHINDUCTOR_COMPILE_THREADS", "TRITON_CACHE_AUTOTUNING")
MAX_MSG = 1 << 20
# threads a server may hold: pyarrow's jemalloc purger (jemalloc's fork handlers stop it and reset it in the child)
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)
# a child's own markers (core/proc.py): run-time settings, never in a server's environment (it is no engine)
MARKERS = ("EAGLE3_PIPELINE_CHILD", "EAGLE3_PIPELINE_LAUNCHER")
PACKAGES = ("eagle3_pipeline.",)  # only our own workers, and of them those that say what to preload (FORK_PRELOAD)
# the room a server keeps at the end of its command line and of its environment (an argument and a variable of that
# many bytes, blanked once it runs): a child writes its own there (_show), so /proc shows what a spawned one's would
ROOM_ARG, ROOM_ENV = 16 * 1024, 64 * 1024
ROOM_VAR = "EAGLE3_FORK_ROOM"


def signature(env: dict[str, str]) -> str:
    """The server a child with `env` can fork from: every variable a package may read at import, and the interpreter."""
    fixed = sorted((k, v) for k, v in env.items() if not k.startswith(RUN_TIME) and k not in IMPORT_MADE + IMPORT_PATH)
    return hashlib.sha256(json.dumps([sys.executable, fixed]).encode()).hexdigest()[:16]


def module_of(argv: list[str]) -> str | None:
    """The module of `python -u -m module args...` run by this interpreter, else None (not forkable)."""
    if len(argv) >= 4 and argv[0] == sys.executable and argv[1:3] == ["-u", "-m"] and argv[3].startswith(PACKAGES):
        return argv[3]
    return None


class ForkedChild:
    """A forked child seen like subprocess.Popen: `pid` (its own process group), `stdout` (its output, text),
    `poll()`, `wait(timeout)`, `returncode` (negative: the signal that ended it). The server reports the exit."""

    def __init__(self, pid: int, conn: socket.socket, out_fd: int):
        self.pid, self._conn, self.returncode = pid, conn, None
        self.stdout = open(out_fd, errors="replace", buffering=1)  # noqa: SIM115

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(MAX_MSG)
        except (TimeoutError, BlockingIOError):  # no word yet (a timeout of 0: non-blocking)
            return
        finally:
            self._conn.settimeout(None)
        if data:
            self.returncode = int(json.loads(data)["rc"])
        else:  # the server ended first: the child's exit is not known; wait until it is gone
            while psutil.pid_exists(self.pid) and (timeout is None or timeout > 0):
                time.sleep(0.1)
                timeout = None if timeout is None else timeout - 0.1
            if psutil.pid_exists(self.pid):
                return
            self.returncode = 255
        self._conn.close()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0)
        return self.returncode


def start(argv: list[str], env: dict[str, str]) -> ForkedChild | None:
    """`argv` forked by the server of its environment (started first when there is none), or None when it is to
    be spawned: no EAGLE3_FORK_SERVER, not `python -u -m`, or no server could take it (it says why on stderr)."""
    root, module = env.get(ENV), module_of(argv)
    if not root or module is None or not (Path(root) / OWNER_FILE).exists():
        return None
    key = signature(env)
    conn = _connect(Path(root), key, env)
    if conn is None:
        failed = Path(root) / f"{key}.failed"
        why = f"its server failed ({failed})" if failed.exists() else "no server"
        print(f"fork server: {module} spawned instead: {why}", file=sys.stderr, flush=True)
        return None
    r, w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        req = {"module": module, "args": argv[4:], "env": env, "cwd": os.getcwd(), "umask": umask,
               "cpus": sorted(os.sched_getaffinity(0))}
        socket.send_fds(conn, [json.dumps(req).encode()], [null, w])
        conn.settimeout(START_S)  # the first request of a server waits for its imports
        reply = json.loads(conn.recv(MAX_MSG) or b'{"refused": "the server ended"}')
        conn.settimeout(None)
    except TimeoutError:
        reply = {"refused": _give_up(Path(root), key)}
    except OSError as e:
        reply = {"refused": f"{type(e).__name__}: {e}"}
    finally:
        os.close(w)
        os.close(null)
    if "pid" not in reply:
        os.close(r)
        conn.close()
        print(f"fork server: {module} spawned instead: {reply.get('refused')}", file=sys.stderr, flush=True)
        return None
    return ForkedChild(int(reply["pid"]), conn, r)


def _give_up(root: Path, key: str) -> str:
    """A server that did not answer in START_S: no request goes to it again, and it is ended (what it forked has a
    session of its own and stays)."""
    (root / f"{key}.failed").write_text(f"no answer in {START_S:.0f} s\n")
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int((root / f"{key}.pid").read_text()), signal.SIGKILL)
    return f"the server did not answer in {START_S:.0f} s"


def _connect(root: Path, key: str, env: dict[str, str]) -> socket.socket | None:
    """A connection to the server of `key`, starting it (one starter at a time) when none answers."""
    path = root / f"{key}.sock"
    conn = _try_connect(path)
    if conn is not None:
        return conn
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _try_connect(path)
        if conn is None and not (root / f"{key}.failed").exists():
            conn = _start_server(root, key, env)
    return conn


def _try_connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    return conn


def _start_server(root: Path, key: str, env: dict[str, str]) -> socket.socket | None:
    """Spawn the server of `key` in its own session, with what its imports may read of `env` (not a child's
    run-time settings: a test that looks for its processes by them must not find the server), wait for it."""
    server_env = {k: v for k, v in env.items() if not k.startswith(RUN_TIME)}
    (root / f"{key}.env.json").write_text(json.dumps(server_env, indent=1, sort_keys=True))
    log = open(root / f"{key}.log", "ab")  # noqa: SIM115
    # the room last of each (_blank_room); the process started forks the server and ends (_detach)
    starter = subprocess.Popen([sys.executable, "-u", "-m", __name__, str(root), key, str(IDLE_S), "." * ROOM_ARG],
                               env={**server_env, ROOM_VAR: "." * ROOM_ENV}, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    log.close()
    end = time.monotonic() + START_S
    while time.monotonic() < end:
        starter.poll()
        conn = _try_connect(root / f"{key}.sock")
        if conn is not None:
            starter.wait()
            return conn
        if (root / f"{key}.failed").exists():
            return None
        time.sleep(0.05)
    _give_up(root, key)
    return None


# ---- the server -------------------------------------------------------------------------------------------------

_IMPORTED: list[str] = []  # the modules this server preloaded
_START_ENV: dict[str, str] = {}  # the server's environment before its imports: the one its children share
_START_HEAD: list[str] = []  # the head of the server's import path (_head): its start directory and PYTHONPATH
_REBUILDS: list[bool] = [False]  # whether a child may rebuild the head for its own (the server's path begins with it)


def _other_threads() -> list[str]:
    """The names of this process's threads but the main one and those that are fork-safe by design."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            if int(tid) != os.getpid() and (name := Path(f"/proc/self/task/{tid}/comm").read_text().strip()) \
                    not in FORK_SAFE_THREADS:
                names.append(name)
    return names


def _preload(module: str) -> str | None:
    """Import `module` and what it names in FORK_PRELOAD here, once; the reason a child cannot be forked, or None."""
    try:
        _IMPORTED.append(module)
        mod = importlib.import_module(module)
        if not hasattr(mod, "FORK_PRELOAD"):
            return f"{module} has no FORK_PRELOAD: it is not written to be forked"
        for name in mod.FORK_PRELOAD:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001
        return f"importing {module} in the server failed: {type(e).__name__}: {e}"
    return _unsafe()


def _head(cwd: str, pythonpath: str | None) -> list[str]:
    """The first entries of a `python -m` child's import path: its directory, then PYTHONPATH's entries made
    absolute from it (an empty one is the directory), each once (`site` drops the repeats, but not of the first)."""
    entries = [os.path.normpath(os.path.join(cwd, e)) for e in (pythonpath.split(os.pathsep) if pythonpath else [])]
    return [cwd, *dict.fromkeys(entries)]


def _found(name: str, entries: list[str]) -> str | None:
    """Where the path finder, searching only `entries`, finds top-level module `name`: a package's directory, a
    module's file or a namespace's portions (as _location names them), or None."""
    spec = importlib.machinery.PathFinder.find_spec(name, entries)
    if spec is None:
        return None
    if spec.origin and spec.has_location:
        return os.path.dirname(spec.origin) if spec.submodule_search_locations is not None else spec.origin
    path = list(spec.submodule_search_locations or [])
    return (path[0] if len(path) == 1 else f"the namespace {os.pathsep.join(path)}") if path else None


def _shadowed(head: list[str]) -> str | None:
    """Why a child whose import path starts with `head` (_head) would not import the modules this server has: one
    of its entries holds a top-level module of the same name elsewhere, or the server took one from its own head
    and the child's holds none; or the server's path cannot be rebuilt for it. None: they are the ones it would."""
    if head == _START_HEAD:
        return None
    if not _REBUILDS[0] or sys.path[:len(_START_HEAD)] != _START_HEAD:
        return "the server's import path cannot be rebuilt for another directory or PYTHONPATH"
    for name, mod in list(sys.modules.items()):
        if "." in name or not (where := _location(mod)):
            continue
        theirs = _found(name, head)
        if theirs != where and (theirs is not None or _found(name, _START_HEAD) == where):
            return f"its import path would take {name} from {theirs or 'elsewhere'}, not {where}"
    return None


def _interpreter_path() -> list[str]:
    """The import path's entries that are the interpreter's own (standard library, site-packages)."""
    return [p for p in sys.path if p.startswith((sys.base_prefix + os.sep, sys.prefix + os.sep))]


def _location(mod) -> str | None:
    """A top-level module's directory (a package) or file, as _found names it; None for a built-in. A namespace
    package of several portions has no one place: any entry of a child's head that holds one differs from it."""
    file = getattr(mod, "__file__", None)
    if file:
        return os.path.dirname(file) if os.path.basename(file).startswith("__init__.") else file
    path = list(getattr(mod, "__path__", None) or [])
    return (path[0] if len(path) == 1 else f"the namespace {os.pathsep.join(path)}") if path else None


def _unsafe() -> str | None:
    """Why this server cannot fork (from now on: an import cannot be undone), or None."""
    if others := _other_threads():  # a fork keeps one thread: a pool another thread holds (OpenMP's) would hang it
        return f"the server runs {len(others) + 1} threads ({', '.join(others)}) after importing {', '.join(_IMPORTED)}"
    return None


def serve(root: Path, key: str, idle_s: float = IDLE_S) -> None:
    """Accept requests on `<root>/<key>.sock` until the owner is gone, the directory is, or `idle_s` pass idle."""
    owner = int((root / OWNER_FILE).read_text())
    path = root / f"{key}.sock"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a server that ended without removing it (its starter holds the lock now)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    refused: dict[str, str | None] = {}
    last = time.monotonic()
    (root / f"{key}.pid").write_text(str(os.getpid()))
    print(f"fork server {key}: ready, pid {os.getpid()}, owner {owner}", flush=True)
    try:
        while psutil.pid_exists(owner) and (root / OWNER_FILE).exists() and time.monotonic() - last < idle_s:
            for sk, _ in sel.select(timeout=1.0):
                if sk.fileobj is listener:
                    conn, _ = listener.accept()
                    _request(conn, sel, listener, key, refused)
                    last = time.monotonic()
                else:  # a child's pidfd: it ended
                    _report(sel, sk)
            if len(sel.get_map()) > 1:  # a child still runs: its exit is to be reported, so the server is not idle
                last = time.monotonic()
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _report(sel: selectors.BaseSelector, sk: selectors.SelectorKey) -> None:
    """Reap an ended child and send its exit code to the connection that asked for it."""
    pid, conn = sk.data
    sel.unregister(sk.fileobj)
    os.close(sk.fd)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
    conn.close()


def _request(conn: socket.socket, sel: selectors.BaseSelector, listener: socket.socket, key: str,
             refused: dict[str, str | None]) -> None:
    """Fork the child a request asks for and watch it (its pidfd), or answer why not."""
    msg, fds, _, _ = socket.recv_fds(conn, MAX_MSG, 2)
    req = json.loads(msg)
    module = req["module"]
    if module not in refused:
        refused[module] = _preload(module)
        # the imports to the collector's permanent generation: a child's collections (vLLM makes three per engine
        # start) pass over only what the child made, and leave the pages it shares with the server alone
        heap.freeze()
    # the server's own signature is its name: its environment is its first starter's without the run-time settings
    why = refused[module] or _unsafe() or (None if signature(req["env"]) == key else "environment differs") \
        or _shadowed(_head(req["cwd"], req["env"].get("PYTHONPATH")))
    req["env"] = _child_env(req["env"])
    req["shown"] = _proc_blocks([sys.executable, "-u", "-m", module, *req["args"]], req["env"])
    why = why or _no_room(req["shown"])
    if why is not None or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"refused": why or "no output pipe"}).encode())
        print(f"fork server: {module} refused: {why}", flush=True)
        conn.close()
        return
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        for sk in list(sel.get_map().values()):  # the other children's pidfds and connections are not its own
            if sk.data:
                os.close(sk.fd)
                sk.data[1].close()
        sel.close()
        listener.close()
        conn.close()
        _child(req, fds)
    for fd in fds:
        os.close(fd)
    sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
    conn.send(json.dumps({"pid": pid}).encode())
    print(f"fork server: {module} forked, pid {pid}", flush=True)


def _child_env(env: dict[str, str]) -> dict[str, str]:
    """A child's environment: its starter's, and what the server's imports set (it is what they did), but a
    starter's own IMPORT_MADE value."""
    made = {k: v for k, v in os.environ.items() if _START_ENV.get(k) != v and not (k in IMPORT_MADE and k in env)}
    return env | made


def _block(items: list[str]) -> bytes:
    return b"".join(x.encode(errors="surrogateescape") + b"\0" for x in items)


def _areas() -> tuple[tuple[int, int], tuple[int, int]]:
    """(start, end) of this process's command line and of its environment in its memory, as /proc reads them."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])  # stat fields 48-51
    return (arg_start, arg_end), (env_start, env_end)


_AREAS: list[tuple[int, int]] = []  # the server's (and so its children's) command-line and environment memory


def _proc_blocks(argv: list[str], env: dict[str, str]) -> tuple[bytes, bytes]:
    """A child's command line and environment as /proc shows them (the bytes _show writes)."""
    return _block(argv), _block([f"{k}={v}" for k, v in env.items()])


def _no_room(blocks: tuple[bytes, bytes]) -> str | None:
    """Why a child's command line or environment (_proc_blocks) would not fit where /proc reads them, or None."""
    if not _AREAS:
        return "the server keeps no room for a child's command line and environment"
    for what, block, (start, end) in zip(("command line", "environment"), blocks, _AREAS, strict=True):
        if len(block) > end - start:
            return f"its {what} ({len(block)} bytes) does not fit the server's room ({end - start})"
    return None


def _show(blocks: tuple[bytes, bytes]) -> None:
    """Write `blocks` (_proc_blocks) where /proc reads this process's command line and environment (the rest blank), so
    that the gpu-gate and a test find a forked child by them as they find a spawned one. Only in a child whose C
    environment no longer points there (os.environ was cleared and refilled: every variable a copy)."""
    for block, (start, end) in zip(blocks, _AREAS, strict=True):
        ctypes.memmove(start, block.ljust(end - start, b"\0"), end - start)


def _blank_room(argv: list[str]) -> None:
    """The server's start: note its two areas and blank the room at their ends (the last argument and ROOM_VAR, each
    after everything the C library may still point to), so that its own command line and environment read true."""
    (arg_start, arg_end), (env_start, env_end) = _areas()
    room = f"{ROOM_VAR}={os.environ.pop(ROOM_VAR, '')}\0".encode()
    if argv[-1] != "." * ROOM_ARG or room[-ROOM_ENV - 1:] != b"." * ROOM_ENV + b"\0" \
            or ctypes.string_at(arg_start, arg_end - arg_start) != _block(argv) \
            or ctypes.string_at(env_end - len(room), len(room)) != room:
        return  # started without the room where it belongs: its children are spawned instead (_no_room)
    _AREAS[:] = [(arg_start, arg_end), (env_start, env_end)]
    kept = _block(argv[:-1])
    ctypes.memset(arg_start + len(kept), 0, arg_end - arg_start - len(kept))
    ctypes.memset(env_end - len(room), 0, len(room))


def _child(req: dict, fds: list[int]) -> None:
    """In the fork: its own session, stdin/stdout/stderr, directory and environment, then `python -m` of the module."""
    rc = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.chdir(req["cwd"])
        head = _head(req["cwd"], req["env"].get("PYTHONPATH"))
        if head != _START_HEAD:  # its own directory and PYTHONPATH first, as `python -m` would put them (_shadowed)
            sys.path[:] = head + [p for p in sys.path[len(_START_HEAD):] if p not in head[1:]]
        os.umask(req["umask"])
        os.sched_setaffinity(0, req["cpus"])  # a spawned child has its starter's cores, not the server's
        os.environ.clear()  # every C-level variable is a copy from now on: the old environment's memory is free
        os.environ.update(req["env"])
        _show(req["shown"])
        if os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.enable()
        if "numpy" in sys.modules:  # numpy's global generator is not reseeded by a fork (random's is)
            sys.modules["numpy"].random.seed()
        sys.argv = [req["module"], *req["args"]]
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc)


def _detach() -> None:
    """The server in a session of its own, no starter's descendant: what it forks is not under any process the
    gpu-gate spares as its own (gpu/stage._protected), as a spawned child whose starter ended is not."""
    if os.fork():
        os._exit(0)
    os.setsid()


def main(argv: list[str]) -> int:
    root, key, idle_s = Path(argv[0]), argv[1], float(argv[2])
    _detach()
    _blank_room(sys.orig_argv)
    heap.tune()  # for its imports and, through the fork, its children's
    _START_ENV.update(os.environ)
    _START_HEAD[:] = _head(os.getcwd(), os.environ.get("PYTHONPATH"))
    # an entry that is also the interpreter's own was dropped from its place after the head: not rebuilt
    _REBUILDS[0] = sys.path[:len(_START_HEAD)] == _START_HEAD and not set(_START_HEAD[1:]) & set(_interpreter_path())
    # OpenBLAS (numpy's, OpenCV's) starts its threads when loaded: one thread here, so that any other thread an
    # import starts is seen (_unsafe); the children have it in their environment (made by the server)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(root, key, idle_s)
    except SystemExit:
        return 0
    except BaseException:
        traceback.print_exc()
        (root / f"{key}.failed").write_text(traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
