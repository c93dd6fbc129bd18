"""A target path that is not a model directory is a config error naming the path, before any stage runs
(core/config.py target_problems, called by every `eagle3` command that loads the target and by the flow head)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eagle3_pipeline.core.config import TargetConfig, target_problems

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_model_directory_is_named_with_what_was_expected(tmp_path):
    missing = tmp_path / "models" / "Kimi-K2.5"
    problems = target_problems(TargetConfig(model=str(missing)))
    assert len(problems) == 1, problems  # the tokenizer defaults to the same path: said once
    assert f"target.model {missing}: no such file or directory" in problems[0]
    assert "expected a local model directory holding config.json" in problems[0]
    assert "a hub id needs target.hub: true" in problems[0]


def test_a_file_or_a_directory_without_a_model_is_named(tmp_path):
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    assert "is a file, expected" in target_problems(TargetConfig(model=str(f)))[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    got = target_problems(TargetConfig(model=str(empty)))
    assert "is a directory without config.json" in got[0]
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    got = target_problems(TargetConfig(model=str(model), tokenizer=str(empty)))
    assert len(got) == 1 and got[0].startswith(f"target.tokenizer {empty}: is a directory without tokenizer.json")


def test_a_hub_id_is_taken_only_where_the_config_says_so(tmp_path):
    assert "a hub id needs target.hub: true" in target_problems(TargetConfig(model="moonshotai/Kimi-K2.5"))[0]
    assert target_problems(TargetConfig(model="moonshotai/Kimi-K2.5", hub=True)) == []
    # with hub on, a local path that exists is still checked
    empty = tmp_path / "empty"
    empty.mkdir()
    assert target_problems(TargetConfig(model=str(empty), hub=True))


def test_the_embedded_targets_pass(tmp_path):
    for d in (".cache/tiny-target", ".cache/tiny-moe", ".cache/smollm2"):
        if (ROOT / d).exists():
            assert target_problems(TargetConfig(model=str(ROOT / d))) == [], d


def test_eagle3_run_names_a_missing_model_before_anything_starts(tmp_path):
    """The reported mistake: a typo in target.model ended `eagle3 run` at prepare with the hub's 'Repo id must be in
    the form' error; now it is exit code 2 (config) naming the path, with no run directory, store or server."""
    eagle3 = Path(sys.executable).with_name("eagle3")
    r = subprocess.run([str(eagle3), "run", "--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--output-dir",
                        str(tmp_path / "runs"), "--set", f"store={tmp_path / 'store'}",
                        "--set", f"target.model={tmp_path / 'tiny-targt'}"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert f"target.model {tmp_path / 'tiny-targt'}: no such file or directory" in " ".join(out.split()), out[-3000:]
    assert "Repo id" not in out
    assert not (tmp_path / "runs").exists() and not (tmp_path / "store").exists()
