"""The GPU stack's wheels as the image installs them: the version and sha256 hashes pinned in
infra/requirements-gpu-k8s.lock, downloaded once from PyPI into a cache (EAGLE3_WHEEL_CACHE, default
~/.cache/eagle3-pipeline/wheels) and checked against the lock's hashes before anything reads them."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

from eagle3_pipeline.core.store import sha256_file

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "infra" / "requirements-gpu-k8s.lock"
PYPI_JSON = os.environ.get("EAGLE3_PYPI_JSON", "https://pypi.org/pypi")


def locked(name: str) -> tuple[str, set[str]]:
    """(version, sha256 hashes) of `name` in the lock."""
    m = re.search(rf"^{re.escape(name)}==(\S+)((?:\s*\\\s*\n\s*--hash=sha256:[0-9a-f]{{64}})+)", LOCK.read_text(), re.M)
    assert m, f"{name} is not pinned with hashes in {LOCK}"
    return m.group(1), set(re.findall(r"sha256:([0-9a-f]{64})", m.group(2)))


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_WHEEL_CACHE", Path.home() / ".cache" / "eagle3-pipeline" / "wheels"))


def locked_wheel(name: str, platform_tag: str = "manylinux_2_28_x86_64") -> Path:
    """The lock's wheel of `name` for Linux x86_64 (or a pure-Python one), hash-checked, from the cache or PyPI."""
    version, hashes = locked(name)
    cache = cache_dir()
    for p in cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"):
        if sha256_file(p) in hashes:
            return p
    with urllib.request.urlopen(f"{PYPI_JSON}/{name}/{version}/json", timeout=60) as r:
        files = json.loads(r.read())["urls"]
    wanted = [f for f in files if f["digests"]["sha256"] in hashes and f["filename"].endswith(".whl")
              and (platform_tag in f["filename"] or f["filename"].endswith("-any.whl"))]
    assert wanted, f"PyPI lists no {name} {version} wheel for {platform_tag} with a hash of the lock"
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / wanted[0]["filename"]
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    with urllib.request.urlopen(wanted[0]["url"], timeout=600) as r, open(tmp, "wb") as f:
        while block := r.read(1 << 20):
            f.write(block)
    got = sha256_file(tmp)
    if got not in hashes:
        tmp.unlink()
        raise AssertionError(f"{wanted[0]['url']}: sha256 {got} is none of the lock's {sorted(hashes)}")
    os.replace(tmp, final)
    return final
