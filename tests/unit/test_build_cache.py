"""The machine-wide cache of tiny builds (tiny/build_cache.py): a miss builds and keeps a copy, a hit
copies it without building, and anything that determines the bytes (config, builder code) is another
key. The builder here is a stand-in that writes a small model directory: the real builders take minutes
and are run by `make tiny tiny-moe` (and the session fixtures) before the suite."""

from __future__ import annotations

import json

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
    (pkg / "store.py").write_text("x = 1\n")
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
