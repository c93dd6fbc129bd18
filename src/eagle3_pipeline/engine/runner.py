"""The model runner every engine runs, chosen here, and the proof that our hooks live in it.

More: docs/internals.md, "engine/runner.py".
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.engine import surface
from eagle3_pipeline.engine.surface import PIN, RUNNER_ENV, V1, V1_RUNNER, V2, V2_RUNNER

RECORD_ENV = "EAGLE3_RUNNER_RECORD_DIR"
_LIVE: set[str] = set()
_STATE = {"installed": False}


class HooksNotLive(EnvironmentProblem):
    """The engine runs a runner our hooks are not on, or a hook never ran: no retry can help."""


def pin() -> dict[str, str]:
    """PIN where the installed vLLM has V1, else nothing: 0.34 refuses any VLLM_USE_V2_MODEL_RUNNER but 1 ("Model
    Runner V1 has been removed. Unset this variable", vllm/platforms/interface.py)."""
    return dict(PIN) if expected() == V1 else {}


def pin_environment() -> None:
    """Set the pin in this process (an in-process engine reads it; spawned engine processes inherit it); on a vLLM
    without V1, drop a pin this process inherited."""
    if expected() == V1:
        os.environ.update(PIN)
    elif os.environ.get(RUNNER_ENV) not in (None, "1"):
        os.environ.pop(RUNNER_ENV)


def watch(record_dir: Path | str) -> Path:
    """An empty `record_dir` for this process's engines to record into (RECORD_ENV, inherited by them) and
    this process's own hooks, installed now where vLLM already loaded its plugins."""
    shutil.rmtree(record_dir, ignore_errors=True)
    Path(record_dir).mkdir(parents=True)
    os.environ[RECORD_ENV] = str(record_dir)
    _LIVE.clear()
    install_if_loaded()
    return Path(record_dir)


def install_if_loaded() -> None:
    """`install` in this process when vLLM is already imported (its plugins loaded before RECORD_ENV was set)."""
    if "vllm" in sys.modules:
        install()


def qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def is_v1(cls: type) -> bool:
    return any(qualname(c) == V1_RUNNER for c in cls.__mro__)


def kind_of(cls: type) -> str | None:
    """V1 or V2 for a runner class (a subclass counts: the CPU runners), else None."""
    names = {qualname(c) for c in cls.__mro__}
    return V1 if V1_RUNNER in names else V2 if V2_RUNNER in names else None


def expected() -> str:
    """The runner kind our engines run on with the installed vLLM: V1 where it has V1 (pinned), else V2 (its
    files, read without importing vLLM)."""
    return V1 if surface.installed_tree().has_module(V1_RUNNER.split(":")[0]) else V2


def _write(name: str, data: dict) -> None:
    d = os.environ.get(RECORD_ENV)
    if not d:
        return
    Path(d).mkdir(parents=True, exist_ok=True)
    path = Path(d) / f"{name}-{os.getpid()}.json"
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def install() -> bool:
    """Record the runner each worker builds (a vLLM general plugin; only where RECORD_ENV is set)."""
    if not os.environ.get(RECORD_ENV):
        return False
    if _STATE["installed"]:
        return True
    from vllm.v1.worker.gpu_worker import Worker

    own = Worker.load_model

    def load_model(self, *args, **kwargs):
        out = own(self, *args, **kwargs)
        cls = type(self.model_runner)
        _write("runner", {"runner": qualname(cls), "v1": is_v1(cls), "kind": kind_of(cls),
                          "pin": os.environ.get(RUNNER_ENV), "pid": os.getpid()})
        return out

    Worker.load_model = load_model
    _STATE["installed"] = True
    return True


def mark_live(hook: str, runner) -> None:
    """Called by a hook each time it runs; records the first run per process (one set lookup after that)."""
    if hook in _LIVE:
        return
    _LIVE.add(hook)
    _write(f"live-{hook}", {"hook": hook, "runner": qualname(type(runner)), "pid": os.getpid()})


def records(record_dir: Path | str) -> tuple[list[dict], dict[str, list[dict]]]:
    """(runner records, hook -> live records) found in `record_dir`."""
    runners, live = [], {}
    for p in sorted(Path(record_dir).glob("*.json")):
        data = json.loads(p.read_text())
        if p.name.startswith("runner-"):
            runners.append(data)
        elif p.name.startswith("live-"):
            live.setdefault(data["hook"], []).append(data)
    return runners, live


def prove(record_dir: Path | str, hooks: tuple[str, ...], who: str, kind: str | None = None) -> str:
    """The runner class the engine runs, once its first request is done; raises HooksNotLive where it is
    not of `kind` (default `expected()`: V1, pinned, where vLLM has it, else V2) or a hook of `hooks` never
    ran in it."""
    kind = kind or expected()
    runners, live = records(record_dir)
    names = sorted({r["runner"] for r in runners})
    if not runners:
        raise HooksNotLive(f"{who}: the engine's workers recorded no runner ({record_dir}): the plugin "
                           f"eagle3_pipeline.engine.runner:install is not loaded in vLLM's processes (is the "
                           f"eagle3-pipeline package installed with its vllm.general_plugins entry points?)")
    kinds = {r.get("kind", V1 if r["v1"] else None) for r in runners}
    if kinds != {kind} and kind == V1:
        raise HooksNotLive(f"{who}: the engine runs {', '.join(names)}, not vLLM's V1 runner {V1_RUNNER} that "
                           f"our hooks wrap: {RUNNER_ENV}={os.environ.get(RUNNER_ENV)!r} here; this vLLM did not "
                           f"take the pin {PIN} (engine/runner.py)")
    if kinds != {kind}:
        raise HooksNotLive(f"{who}: the engine runs {', '.join(names)}, not vLLM's {kind} runner "
                           f"{V2_RUNNER if kind == V2 else V1_RUNNER} that our {kind} hooks wrap (engine/runner.py)")
    unpinned = sorted({str(r.get("pin")) for r in runners if r.get("pin") != PIN[RUNNER_ENV]})
    if kind == V1 and unpinned:
        raise HooksNotLive(f"{who}: the engine's workers ran with {RUNNER_ENV}={', '.join(unpinned)}, not "
                           f"{PIN[RUNNER_ENV]}: on CUDA that vLLM builds Model Runner V2, where our V1 hooks are not "
                           f"(start engines with build.engine_env / build.server_env)")
    dead = [h for h in hooks if h not in live]
    if dead:
        raise HooksNotLive(f"{who}: the hook(s) {', '.join(dead)} never ran in the engine's runner "
                           f"{', '.join(names)} (the engine's first request is done): their vLLM plugin is not "
                           f"loaded in the worker processes, or this vLLM calls other methods "
                           f"(engine/surface.py lists what they wrap)")
    return ", ".join(names)
