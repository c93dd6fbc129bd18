"""The GPU stack's wheels as the image installs them: the version and sha256 hashes pinned in a lock
(infra/requirements-gpu-k8s.lock by default; infra/vllm-wheels.lock holds one entry per supported vLLM), fetched
once through the package index pip is configured to use (`pip download --require-hashes`: the user's index,
find-links and certificates, never a hard-coded URL) into a cache (EAGLE3_WHEEL_CACHE, default
~/.cache/eagle3-pipeline/wheels), and checked against the lock's hashes before anything reads them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from eagle3_pipeline.core.store import sha256_file

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "infra" / "requirements-gpu-k8s.lock"
VLLM_WHEELS = ROOT / "infra" / "vllm-wheels.lock"  # one entry per supported vLLM version


class WheelUnavailable(RuntimeError):
    """The lock's wheel is neither in the cache nor reachable through the configured index."""


def locked(name: str, lock: Path = LOCK, version: str | None = None) -> tuple[str, set[str]]:
    """(version, sha256 hashes) of `name` in the lock: its one entry, or the entry of `version` where the lock
    holds several (infra/vllm-wheels.lock)."""
    found = re.findall(rf"^{re.escape(name)}==(\S+)((?:\s*\\\s*\n\s*--hash=sha256:[0-9a-f]{{64}})+)", lock.read_text(), re.M)
    if version is not None:
        found = [f for f in found if f[0] == version]
    assert found, f"{name}{'==' + version if version else ''} is not pinned with hashes in {lock}"
    assert len(found) == 1, f"{lock} pins {name} {len(found)} times ({[f[0] for f in found]}): name the version"
    return found[0][0], set(re.findall(r"sha256:([0-9a-f]{64})", found[0][1]))


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_WHEEL_CACHE", Path.home() / ".cache" / "eagle3-pipeline" / "wheels"))


def pip_command() -> list[str]:
    """A pip that reads this machine's pip configuration: EAGLE3_PIP, this interpreter's pip, the base
    interpreter's (the project's venv is made without pip), or pip3 on PATH."""
    if os.environ.get("EAGLE3_PIP"):
        return os.environ["EAGLE3_PIP"].split()
    for py in dict.fromkeys((sys.executable, getattr(sys, "_base_executable", sys.executable))):
        if subprocess.run([py, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [py, "-m", "pip"]
    if pip := shutil.which("pip3") or shutil.which("pip"):
        return [pip]
    raise WheelUnavailable("no pip found (EAGLE3_PIP, this Python's, its base Python's, pip3 on PATH) to fetch wheels")


def locked_wheel(name: str, platform_tag: str = "manylinux_2_28_x86_64", lock: Path = LOCK,
                 version: str | None = None) -> Path:
    """The lock's wheel of `name` (of `version`, where the lock pins several) for Linux x86_64 (or a pure-Python
    one), hash-checked, from the cache or through the configured index."""
    version, hashes = locked(name, lock, version)
    cache = cache_dir()
    for p in cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"):
        if sha256_file(p) in hashes:
            return p
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        req = Path(tmp) / "requirement.txt"
        req.write_text(f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(hashes)) + "\n")
        cmd = [*pip_command(), "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--platform", platform_tag, "--python-version", "3.11", "--implementation", "cp",
               "--disable-pip-version-check", "-q", "-d", tmp, "-r", str(req)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = [p for p in Path(tmp).glob("*.whl")]
        if r.returncode != 0 or len(got) != 1:
            raise WheelUnavailable(
                f"{name}=={version} ({platform_tag}, one of the {len(hashes)} sha256 hashes in {lock.name}) could not "
                f"be fetched through pip's configured index: `{' '.join(cmd[:-2])}` exited {r.returncode}: "
                f"{(r.stderr or r.stdout).strip()[-600:]}\nSeed the cache instead: on a machine that reaches the wheel, "
                f"`pip download --no-deps --only-binary=:all: --platform {platform_tag} --python-version 3.11 "
                f"{name}=={version} -d DIR`, then copy the .whl into {cache} (or point EAGLE3_WHEEL_CACHE at DIR).")
        wheel = got[0]
        if (digest := sha256_file(wheel)) not in hashes:  # pip checked it already; a second look costs seconds
            raise WheelUnavailable(f"{wheel.name}: sha256 {digest} is none of {lock.name}'s {sorted(hashes)}")
        final = cache / wheel.name
        os.replace(wheel, final)
    return final
