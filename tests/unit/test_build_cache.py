"""The machine-wide cache of tiny builds (tiny/build_cache.py): a miss builds and keeps a copy, a hit
copies it without building, and anything that determines the bytes (config, builder code) is another
key. The builder here is a stand-in that writes a small model directory: the real builders take minutes
and are run by `make tiny tiny-moe` (and the session fixtures) before the suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from eagle3_pipeline.tiny import build_cache
from eagle3_pipeline.tiny.moe_target import TinyMoeConfig
from eagle3_pipeline.tiny.target import TinyTargetConfig


class Cfg(BaseModel):
    seed: int = 0


def fake_build(calls: list):
    def build(cfg, out, log=print):
        calls.append(cfg.seed)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_bytes(bytes([cfg.seed]) * 64)
        summary = {"params": 64, "greedy_accuracy": 0.5, "build_seconds": 1.0, "seed": cfg.seed}
        (out / "tiny_target.json").write_text(json.dumps(summary))
        return summary
    return build


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(build_cache.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_miss_builds_and_keeps_a_copy_a_hit_copies_it(tmp_path, cache):
    calls: list = []
    first = build_cache.cached_build("llama", Cfg(), tmp_path / "a", fake_build(calls), log=lambda m: None)
    assert calls == [0]
    entry = cache / "llama" / first["build_key"]
    assert (entry / "model.safetensors").read_bytes() == bytes([0]) * 64
    assert json.loads((tmp_path / "a" / "tiny_target.json").read_text())["build_key"] == first["build_key"]
    logs: list = []
    second = build_cache.cached_build("llama", Cfg(), tmp_path / "b", fake_build(calls), log=logs.append)
    assert calls == [0], "a hit must not build"
    assert second["build_key"] == first["build_key"] and second["reused_from"] == str(entry)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    assert any("reused" in m for m in logs)
    assert not list((cache / "llama").glob("*.tmp-*")), "no temporary copy left behind"


def test_another_config_or_kind_is_another_build(tmp_path, cache):
    calls: list = []
    a = build_cache.cached_build("llama", Cfg(seed=0), tmp_path / "a", fake_build(calls), log=lambda m: None)
    b = build_cache.cached_build("llama", Cfg(seed=1), tmp_path / "b", fake_build(calls), log=lambda m: None)
    c = build_cache.cached_build("moe", Cfg(seed=0), tmp_path / "c", fake_build(calls), log=lambda m: None)
    assert calls == [0, 1, 0]
    assert len({a["build_key"], b["build_key"], c["build_key"]}) == 3
    # the real configs: a changed default (e.g. the training steps) changes the key
    assert build_cache.build_key("llama", TinyTargetConfig()) != build_cache.build_key("llama", TinyTargetConfig(max_steps=1))
    assert build_cache.build_key("moe", TinyMoeConfig()) == build_cache.build_key("moe", TinyMoeConfig())


def test_the_builder_code_is_in_the_key(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "tiny").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "core").mkdir()
    for name in ("__init__.py", "data/__init__.py", "data/chat.py", "core/__init__.py", "core/store.py",
                 "core/errors.py"):
        (pkg / name).write_text("x = 1\n")
    (pkg / "tiny" / "target.py").write_text("STEPS = 320\n")
    monkeypatch.setattr(build_cache, "PACKAGE", pkg)
    before = build_cache.build_key("llama", Cfg())
    (pkg / "tiny" / "target.py").write_text("STEPS = 321\n")
    assert build_cache.build_key("llama", Cfg()) != before
    (pkg / "tiny" / "target.py").write_text("STEPS = 320\n")
    assert build_cache.build_key("llama", Cfg()) == before
    (pkg / "data" / "chat.py").write_text("# the chat encoder the corpus goes through\n")
    assert build_cache.build_key("llama", Cfg()) != before


def test_off_and_force_build_from_nothing(tmp_path, cache, monkeypatch):
    calls: list = []
    build_cache.cached_build("llama", Cfg(), tmp_path / "a", fake_build(calls), log=lambda m: None)
    build_cache.cached_build("llama", Cfg(), tmp_path / "b", fake_build(calls), log=lambda m: None, reuse=False)
    assert calls == [0, 0]
    monkeypatch.setenv(build_cache.ENV, "off")
    out = build_cache.cached_build("llama", Cfg(), tmp_path / "c", fake_build(calls), log=lambda m: None)
    assert calls == [0, 0, 0] and "reused_from" not in out


def test_a_cache_that_cannot_be_written_still_builds(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(build_cache.ENV, str(blocker / "cache"))
    calls: list = []
    logs: list = []
    out = build_cache.cached_build("llama", Cfg(), tmp_path / "a", fake_build(calls), log=logs.append)
    assert calls == [0] and (tmp_path / "a" / "tiny_target.json").exists() and out["build_key"]
    assert any("could not keep" in m for m in logs)


def test_every_project_module_the_builders_import_is_in_the_key():
    """The key hashes `SOURCES`, not the whole package (a change to prepare.py must not retrain two
    targets: ~20 min of CI). So: walk every `eagle3_pipeline` import of the builders, at any depth and
    inside functions too, and require each module's file to be covered."""
    import ast

    pkg = build_cache.PACKAGE
    covered = set()
    for name in build_cache.SOURCES:
        p = pkg / name
        covered |= set(p.rglob("*.py")) if p.is_dir() else {p}

    def module_file(mod: str) -> Path:
        rel = Path(*mod.split(".")[1:])
        return pkg / rel / "__init__.py" if (pkg / rel).is_dir() else pkg / rel.with_suffix(".py")

    todo = [pkg / "tiny" / "target.py", pkg / "tiny" / "moe_target.py"]
    seen: set[Path] = set()
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
                for i in range(1, len(parts) + 1):  # every package on the way is imported too
                    target = module_file(".".join(["eagle3_pipeline", *parts[1:i]])) if i > 1 else pkg / "__init__.py"
                    if target.exists():
                        todo.append(target)
    assert pkg / "data" / "chat.py" in seen and pkg / "tiny" / "training.py" in seen  # the walk works
    missing = sorted(str(f.relative_to(pkg)) for f in seen - covered if f != Path(build_cache.__file__).resolve())
    assert not missing, f"the builders import modules the build key does not hash: {missing}"


def test_the_builds_kept_in_the_repository_are_the_current_ones():
    """prebuilt/<kind>/<key>/ (the tiny builds a fresh clone copies instead of training): each kind kept
    there is the build of today's builder code, config and libraries. After a change to what the key
    covers, rebuild (`make tiny tiny-moe`) and commit the new build in place of the old one."""
    current = {"llama": build_cache.build_key("llama", TinyTargetConfig()),
               "moe": build_cache.build_key("moe", TinyMoeConfig())}
    kept = {d.name: sorted(k.name for k in d.iterdir()) for d in build_cache.PREBUILT.iterdir()} \
        if build_cache.PREBUILT.is_dir() else {}
    for kind, keys in kept.items():
        assert keys == [current[kind]], (f"prebuilt/{kind} holds {keys}, the builder's key is now {current[kind]}: "
                                         f"rebuild with `make tiny tiny-moe` and commit the new build")
        summary = json.loads((build_cache.PREBUILT / kind / keys[0] / build_cache.SUMMARY).read_text())
        assert summary["build_key"] == keys[0]


def test_a_prebuilt_build_is_copied_not_built(tmp_path, cache, monkeypatch):
    calls: list = []
    kept = tmp_path / "prebuilt"
    monkeypatch.setattr(build_cache, "PREBUILT", kept)
    key = build_cache.build_key("llama", Cfg())
    fake_build([])(Cfg(), kept / "llama" / key)
    (kept / "llama" / key / "tiny_target.json").write_text(json.dumps({"params": 64, "build_key": key}))
    s = build_cache.cached_build("llama", Cfg(), tmp_path / "out", fake_build(calls), log=lambda m: None)
    assert calls == [] and s["reused_from"] == str(kept / "llama" / key)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == bytes([0]) * 64


def test_a_source_that_is_not_there_stops_the_key(tmp_path, monkeypatch):
    """A moved or renamed module named in SOURCES would otherwise leave the key without a word."""
    monkeypatch.setattr(build_cache, "PACKAGE", tmp_path)
    with pytest.raises(FileNotFoundError, match="store.py"):
        build_cache.build_key("llama", Cfg(), sources=("store.py",))
