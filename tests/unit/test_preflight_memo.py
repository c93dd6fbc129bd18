"""Preflight's import probe and its memo (preflight/import_memo.py): a pass on the same installed files is not
imported again, a failure is never remembered, a new install or an edited module file is another key, and
EAGLE3_PREFLIGHT_MEMO=off imports every time."""

from __future__ import annotations

import os

import pytest

import eagle3_pipeline.preflight.stage as pf
from eagle3_pipeline.preflight import import_memo
from eagle3_pipeline.records.contracts import ModelDims


@pytest.fixture()
def memo(tmp_path, monkeypatch):
    monkeypatch.setenv(import_memo.ENV, str(tmp_path / "memo"))
    return tmp_path / "memo"


def _dims(**kw) -> ModelDims:
    return ModelDims(num_layers=4, hidden_size=64, vocab_size=128, head_dim=32, model_type="llama", architectures=[], **kw)


def _probe(monkeypatch, apis: dict) -> list[tuple]:
    """REQUIRED_APIS replaced by `apis`; returns the list _check_api's calls are appended to."""
    calls: list[tuple] = []
    real = pf._check_api

    def counted(*a):
        calls.append(a)
        return real(*a)
    monkeypatch.setattr(pf, "REQUIRED_APIS", apis)
    monkeypatch.setattr(pf, "_check_api", counted)
    return calls


def test_a_pass_is_remembered_and_not_imported_again(memo, monkeypatch):
    calls = _probe(monkeypatch, {"json": ("json", "dumps", ("obj",))})
    lines: list[str] = []
    assert pf.import_problems(_dims(), lines.append) == [] and len(calls) == 1 and lines == []
    assert len(list(memo.glob("*.json"))) == 1
    assert pf.import_problems(_dims(), lines.append) == [] and len(calls) == 1  # not probed again
    assert len(lines) == 1 and "not imported again" in lines[0] and import_memo.ENV in lines[0]


def test_a_failure_is_reported_every_time_and_never_remembered(memo, monkeypatch):
    calls = _probe(monkeypatch, {"connector": ("json", "no_such_function", ()),
                                 "engine": ("os", "getcwd", ("speculative_config",))})
    for n in (1, 2):
        problems = pf.import_problems(_dims(), print)
        assert len(calls) == 2 * n
        assert problems == ["connector: json.no_such_function not importable (AttributeError: module 'json' has no "
                            "attribute 'no_such_function')",
                            "engine: os.getcwd does not accept ['speculative_config']"], problems
    assert not memo.exists() or list(memo.glob("*.json")) == []


def test_what_is_checked_is_part_of_the_key(memo, monkeypatch):
    calls = _probe(monkeypatch, {"json": ("json", "dumps", ())})
    pf.import_problems(_dims(), print)
    monkeypatch.setattr(pf, "REQUIRED_APIS", {"json": ("json", "loads", ())})
    pf.import_problems(_dims(), print)
    assert len(calls) == 2  # another API: probed


def test_off_imports_every_time(monkeypatch, tmp_path):
    monkeypatch.setenv(import_memo.ENV, "off")
    calls = _probe(monkeypatch, {"json": ("json", "dumps", ())})
    for _ in range(2):
        assert pf.import_problems(_dims(), print) == []
    assert len(calls) == 2 and import_memo.memo_dir() is None


def _fake_dist(root, version="1.0"):
    pkg = root / "e3fakepkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    info = root / f"e3fakepkg-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: e3fakepkg\nVersion: {version}\n")
    (info / "RECORD").write_text(f"e3fakepkg/__init__.py,sha256=one,6\ne3fakepkg-{version}.dist-info/METADATA,,\n")
    return pkg, info


def test_a_new_install_or_an_edited_module_is_another_key(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(import_memo, "DISTS", ("e3fakepkg",))
    pkg, info = _fake_dist(tmp_path)
    first = import_memo.key({"a": 1}, ["e3fakepkg"])
    assert import_memo.key({"a": 1}, ["e3fakepkg"]) == first
    assert import_memo.key({"a": 2}, ["e3fakepkg"]) != first
    (info / "RECORD").write_text((info / "RECORD").read_text().replace("sha256=one", "sha256=two"))  # reinstalled
    second = import_memo.key({"a": 1}, ["e3fakepkg"])
    assert second != first
    st = (pkg / "__init__.py").stat()
    os.utime(pkg / "__init__.py", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # edited in place
    assert import_memo.key({"a": 1}, ["e3fakepkg"]) != second


def test_no_home_directory_keeps_no_memo(monkeypatch):
    monkeypatch.delenv(import_memo.ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(import_memo.os.path, "expanduser", lambda p: p)  # what it returns when it finds no home
    assert import_memo.memo_dir() is None
    monkeypatch.setenv("XDG_CACHE_HOME", "/c")
    assert import_memo.memo_dir() == import_memo.Path("/c/eagle3-pipeline/preflight")
