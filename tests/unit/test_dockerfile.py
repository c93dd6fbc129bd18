"""infra/Dockerfile builds the venv with a Python that pyproject.toml accepts, and one that its base
image can install: Ubuntu's own python3 is 3.12 on 24.04 (3.10 on 22.04), so another minor version
must come from a PPA the Dockerfile adds. (No docker here: this reads the files.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
UBUNTU_PYTHON = {"20.04": "3.8", "22.04": "3.10", "24.04": "3.12"}


def test_dockerfile_python_matches_requires_python():
    text = (ROOT / "infra" / "Dockerfile").read_text()
    requires = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    venv = re.search(r"python(3\.\d+) -m venv", text)
    assert venv, "infra/Dockerfile: no `python3.X -m venv` line"
    minor = venv.group(1)
    assert f"{minor}.0" in requires, f"the image's venv uses Python {minor}; pyproject.toml requires {requires}"
    base = re.search(r"^FROM \S+ubuntu(\d+\.\d+)\b", text, re.M)
    assert base, "infra/Dockerfile: base image is not an Ubuntu-based one this test knows"
    ubuntu = base.group(1)
    assert re.search(rf"apt-get install[^\n]*\bpython{re.escape(minor)}\b", text), f"python{minor} is not installed"
    if UBUNTU_PYTHON[ubuntu] != minor:
        assert "ppa:deadsnakes/ppa" in text, (f"Ubuntu {ubuntu} ships Python {UBUNTU_PYTHON[ubuntu]}, not {minor}: "
                                              "the Dockerfile must add a source for it")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of infra/Dockerfile, continuation lines joined, comments dropped."""
    text = (ROOT / "infra" / "Dockerfile").read_text()
    text = re.sub(r"\\\n\s*", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)]


def test_dependencies_are_installed_from_the_lock_before_the_code_is_copied():
    """An edit of src/ must not rebuild the multi-GB dependency layer: the lock is copied and installed
    (hash-checked, nothing resolved) before any project file is copied, and the project is installed after
    the code without dependencies."""
    ins = _instructions()
    idx = {i: (k, a) for i, (k, a) in enumerate(ins)}
    lock_copy = [i for i, (k, a) in idx.items() if k == "COPY" and "requirements-gpu-k8s.lock" in a]
    deps = [i for i, (k, a) in idx.items() if k == "RUN" and "--require-hashes" in a and "-r " in a]
    code = [i for i, (k, a) in idx.items() if k == "COPY" and re.match(r"(src|flows|tasks|configs|pyproject\.toml)\b", a)]
    project = [i for i, (k, a) in idx.items() if k == "RUN" and re.search(r"pip install[^&]*--no-deps[^&]*-e \.", a)]
    assert lock_copy and deps and code and project, ins
    assert lock_copy[0] < deps[0] < min(code) < project[0], "order: lock, dependencies, code, project"
    assert "--no-deps" in idx[deps[0]][1], "the lock is complete: pip must not resolve anything beside it"


def test_runs_as_a_fixed_non_root_user_matching_the_job_templates():
    import json

    users = [a for k, a in _instructions() if k == "USER"]
    assert users, "infra/Dockerfile sets no USER: it runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users  # numeric: runAsNonRoot can check it
    for name in ("k8s-gpu-job-template.json", "k8s-cpu-job-template.json"):
        pod = json.loads((ROOT / "infra" / name).read_text())["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == int(uid) and pod["securityContext"]["runAsNonRoot"] is True


def _lock() -> dict[str, str]:
    text = (ROOT / "infra" / "requirements-gpu-k8s.lock").read_text()
    return {m.group(1).lower().replace("_", "-"): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)}


def test_the_lock_pins_every_dependency_of_the_image_within_pyproject():
    """infra/requirements-gpu-k8s.lock holds a version (and hashes) for each requirement of pyproject.toml's
    base + gpu + k8s sets that satisfies it: a dependency added or re-pinned in pyproject.toml without
    regenerating the lock fails here, not in a docker build."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = _lock()
    text = (ROOT / "infra" / "requirements-gpu-k8s.lock").read_text()
    assert text.count("--hash=sha256:") >= len(lock), "every pin carries its hashes (--require-hashes)"
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]
            + project["optional-dependencies"]["k8s"]]
    problems = []
    for r in reqs:
        name = r.name.lower().replace("_", "-")
        if name not in lock:
            problems.append(f"{r}: not in the lock")
        elif not r.specifier.contains(lock[name], prereleases=True):
            problems.append(f"{r}: the lock has {lock[name]}")
    assert not problems, "regenerate infra/requirements-gpu-k8s.lock (its header says how): " + "; ".join(problems)
    assert "torch" in lock and "vllm" in lock and "prefect-kubernetes" in lock


def test_build_context_is_limited_to_what_the_image_copies():
    ignore = [line for line in (ROOT / "infra" / "Dockerfile.dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "**", "exclude everything (.venv, .cache, runs, prebuilt), then re-include what is copied"
    copied = {a.split()[0] for k, a in _instructions() if k == "COPY" and not a.startswith("--")}
    for path in copied:
        if path.startswith("infra/requirements"):
            continue
        assert any(line.lstrip("!").split("/")[0] == path.split("/")[0] for line in ignore if line.startswith("!")), path


def test_the_image_can_compile_what_a_gpu_engine_compiles():
    """Triton builds its CUDA driver stub with a C compiler at its first kernel (so do FlashInfer's JIT and
    torch.compile): the image installs one, and the build checks it runs."""
    runs = " ".join(a for k, a in _instructions() if k == "RUN")
    installs = " ".join(re.findall(r"apt-get install[^&]*", runs))
    assert re.search(r"\b(gcc|build-essential|clang)\b", installs), f"no C compiler installed: {installs}"
    assert re.search(r"\b(gcc|cc|clang) --version\b", runs), "the build never runs the compiler it installed"
    assert "python3.11-dev" in installs, "Triton's driver stub includes Python.h"


def test_every_python_package_of_the_image_is_hash_checked():
    """Nothing is pip-installed beside the lock but the project itself (without dependencies): setuptools, its
    build backend, is the lock's, hash-checked."""
    runs = [a for k, a in _instructions() if k == "RUN"]
    for a in runs:
        for cmd in re.findall(r"pip install ([^&]*)", a):
            assert "--require-hashes" in cmd or re.search(r"--no-deps\b.*-e \.", cmd), f"unhashed install: pip install {cmd}"
    assert "setuptools" in _lock(), "the lock must pin setuptools (the project's build backend)"


def test_compile_caches_live_on_the_store_volume():
    """Triton, torch.compile (inductor), vLLM and FlashInfer caches on the store every GPU Job mounts, so an
    engine start does not recompile in every pod."""
    import json

    pod = json.loads((ROOT / "infra" / "k8s-gpu-job-template.json").read_text())[
        "job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    store = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "store")
    env = {e["name"]: e.get("value") for e in container["env"]}
    for key in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE"):
        assert key in env and env[key].startswith(store.rstrip("/") + "/"), f"{key}: {env.get(key)} not under {store}"


def test_image_script_builds_for_the_nodes_platform_and_refuses_a_stale_image(tmp_path):
    """infra/k8s/image.sh: `docker build --platform linux/amd64` (a laptop's arm64 build would not run on the GPU
    nodes) with the revision as a label; an EAGLE3_IMAGE built from another revision is refused, naming both."""
    import os
    import subprocess

    script = ROOT / "infra" / "k8s" / "image.sh"
    text = script.read_text()
    assert re.search(r"docker build --platform \"\$\{EAGLE3_IMAGE_PLATFORM:-linux/amd64\}\"", text)
    assert "org.opencontainers.image.revision=$tag" in text
    image = "registry.example/eagle3@sha256:" + "ab" * 32
    env = {**os.environ, "EAGLE3_IMAGE": image, "EAGLE3_IMAGE_REVISION": "0123456789ab"}
    r = subprocess.run(["bash", str(script), "push"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "EAGLE3_IMAGE was built from 0123456789ab, this checkout is" in r.stderr, r.stderr
    here = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
                          capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run(["bash", str(script), "push"], env={**env, "EAGLE3_IMAGE_REVISION": here},
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == image, r.stderr
