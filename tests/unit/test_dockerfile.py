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
