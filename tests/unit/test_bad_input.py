"""The bad-input corpus: every kind of broken config, data row, model directory and stored file the
pipeline can be handed, and what each one gets: an error that names the file / key / row / layer /
shape, or a quarantine entry with its reason; through the `eagle3` command, the exit code of its
category (docs/operations.md, "Exit codes").

The tables below are the documented corpus. Every case runs the real code on CPU (load_config,
prepare, preflight, the verify structure check, the vocab readers, the store's atomic writes, the
CLI); no vLLM engine: the hidden-state cases write records for real tokenized rows themselves.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.core.config import PrepareConfig, SourceConfig, TargetConfig, load_config
from eagle3_pipeline.core.errors import ConfigError, DiskFull, ExitCode, GateFailed, InputError, StageTimeout, exit_code
from eagle3_pipeline.verify.stage import VerifyFailed

ROOT = Path(__file__).resolve().parents[2]
EAGLE3 = ROOT / ".venv" / "bin" / "eagle3"
TINY_YAML = ROOT / "configs" / "tiny-cpu.yaml"
LAYER_IDS, HIDDEN = [2, 4, 5, 8], 128  # the tiny target: 8 layers, default aux ids + the last


def good_row(i: int) -> dict:
    return {"id": f"g{i}", "messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                        {"role": "assistant", "content": f"{i} + 1 = {i + 1}."}]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_config(tmp_path: Path, tiny_target: Path, source: Path, *extra: str) -> Path:
    """A config file: configs/tiny-cpu.yaml with this test's store, model and source."""
    import yaml

    cfg = load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={tiny_target}",
                                  f"prepare.sources=[{{path: {source}}}]", "prepare.heldout_rows=2", *extra])
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def cli(*args: str, preexec_fn=None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real console script, as a user runs it (wide columns: rich would wrap long lines)."""
    return subprocess.run([str(EAGLE3), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "500"}, preexec_fn=preexec_fn, cwd=cwd)


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """The same command in this process (typer's runner): no second start of torch/transformers."""
    from typer.testing import CliRunner

    from flows.cli import app

    res = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)


def error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("eagle3 ")]
    assert len(lines) == 1, stderr
    return lines[0]


# ----------------------------------------------------------------------------------------- config

CONFIG_CASES = {  # kind: (overrides of configs/tiny-cpu.yaml, fragments the ConfigError must contain)
    "unknown key": (["train.epochz=3"], ["train.epochz: unknown key (did you mean 'epochs'?)"]),
    "unknown key inside a list": (["prepare.sources=[{paht: a.jsonl}]"],
                                  ["prepare.sources[0].paht: unknown key (did you mean 'path'?)",
                                   "prepare.sources[0].path: required key missing"]),
    "wrong type": (["train.epochs=three"], ["train.epochs: Input should be a valid integer", "'three'"]),
    "wrong type inside a list": (["extract.layer_ids=[2, x, 5]"], ["extract.layer_ids[1]: Input should be a valid integer"]),
    "value outside a choice": (["extract.storage_dtype=fp16"], ["extract.storage_dtype: Input should be 'auto', 'bf16' or 'fp8'"]),
    "section that is not a mapping": (["target=5"], ["target: Input should be a valid dictionary"]),
    "dataset name that climbs out of the store": (["prepare.dataset=../../x"],
                                                  ["prepare.dataset: '../../x' is not a plain directory name"]),
    "dataset name that is an absolute path": (["prepare.dataset=/etc/x"], ["prepare.dataset: '/etc/x' is not a plain"]),
    "dataset name '..'": (["prepare.dataset=.."], ["prepare.dataset: '..' is not a plain directory name"]),
    "dataset name with a slash": (["prepare.dataset=org/name"], ["prepare.dataset: 'org/name' is not a plain"]),
    "override value that is not YAML": (["train.lr=[1, 2"], ["override 'train.lr=[1, 2'", "not valid YAML"]),
}


@pytest.mark.parametrize("kind", CONFIG_CASES)
def test_config_error_names_the_key(kind):
    overrides, fragments = CONFIG_CASES[kind]
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_YAML, overrides)
    msg = str(ei.value)
    assert msg.startswith(f"config {TINY_YAML}") or msg.startswith("override"), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert exit_code(ei.value) == ExitCode.CONFIG == 2


CONFIG_FILES = {  # kind: (file text, fragments)
    "YAML syntax error": ("name: x\ntarget: {model: a\nprepare: 3\n", ["YAML syntax error at line 3, column 8: expected ',' or '}'"]),
    "top level is a list": ("- name\n- target\n", ["expected a mapping of keys at the top level, found list"]),
    "required section missing": ("name: x\nprepare: {sources: [{path: a.jsonl}]}\n", ["target: required key missing"]),
}


@pytest.mark.parametrize("kind", CONFIG_FILES)
def test_config_file_error_names_the_file(kind, tmp_path):
    text, fragments = CONFIG_FILES[kind]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert str(ei.value).startswith(f"config {path}: ")
    for frag in fragments:
        assert frag in str(ei.value), (frag, str(ei.value))


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=f"config {tmp_path / 'nope.yaml'}: file not found"):
        load_config(tmp_path / "nope.yaml")
    res = cli("prepare", "-c", str(tmp_path / "nope.yaml"))  # typer's own check: a usage error, code 2
    assert res.returncode == 2 and "does not exist" in res.stderr


@pytest.mark.parametrize("override,fragment", [
    ("train.epochz=3", "train.epochz: unknown key (did you mean 'epochs'?)"),
    ("prepare.dataset=../../escape", "prepare.dataset: '../../escape' is not a plain directory name"),
])
def test_config_errors_through_the_cli_exit_2(tmp_path, override, fragment):
    res = cli("prepare", "-c", str(TINY_YAML), "--set", override, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    line = error_line(res.stderr)
    assert line.startswith("eagle3 prepare: error 2 (config): ConfigError: config ") and fragment in line, line
    assert not (tmp_path / "runs").exists()  # nothing was written for a config that does not load


# ------------------------------------------------------------------------------------ data rows

ROWS = [  # kind: (row as written to the .jsonl file, fragment of the quarantine reason)
    ("malformed JSON line", '{"id": "x1", "messages": [{"role": "user", "content": "hi"', "malformed JSON line: "),
    ("JSON line that is not an object", "[1, 2, 3]", "JSON line is not an object"),
    ("unknown format", {"id": "x3", "text": "plain"}, "unknown format: keys ['id', 'text']"),
    ("no turns", {"id": "x4", "messages": []}, "no turns"),
    ("turn that is not an object", {"id": "x5", "messages": ["hi", {"role": "assistant", "content": "a"}]},
     "turn 0 is not an object"),
    ("missing role", {"id": "x6", "messages": [{"content": "hi"}, {"role": "assistant", "content": "a"}]},
     "turn 0: missing role"),
    ("unknown role", {"id": "x7", "messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "a"}]},
     "turn 0: unknown role 'wizard'"),
    ("unknown ShareGPT speaker", {"id": "x8", "conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "a"}]},
     "turn 1: unknown role 'robot'"),
    ("missing content", {"id": "x9", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
     "turn 1 (assistant): missing content"),
    ("empty content", {"id": "x10", "messages": [{"role": "user", "content": " \n "}, {"role": "assistant", "content": "a"}]},
     "turn 0 (user): empty content"),
    ("non-string content", {"id": "x11", "messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "a"}]},
     "malformed row: turn 0 (user): content is int, expected a string or a list of text parts"),
    ("non-text content part", {"id": "x12", "messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]},
                                                         {"role": "assistant", "content": "a"}]},
     "malformed row: turn 0 (user): unsupported content part"),
    ("no assistant turn", {"id": "x13", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
     "no assistant turn"),
    ("over-length prompt", {"id": "x14", "messages": [{"role": "user", "content": "long " * 200},
                                                      {"role": "assistant", "content": "ok"}]},
     "over-length prompt: 0 supervised tokens within max_length 64 (minimum 1)"),
    ("duplicate id", {"id": "g3", "messages": [{"role": "user", "content": "dup"}, {"role": "assistant", "content": "dup"}]},
     "duplicate id 'g3' (first at {src} row 3)"),
    ("pre-tokenized lengths differ", {"id": "x16", "input_ids": [1, 2, 3], "loss_mask": [0, 1]},
     "input_ids has 3 tokens, loss_mask 2"),
    ("pre-tokenized id outside the vocab", {"id": "x17", "input_ids": [1, 2, 99999], "loss_mask": [0, 1, 1]},
     "token ids [99999] outside the tokenizer's vocab of 908"),
    ("pre-tokenized id that is not a number", {"id": "x18", "input_ids": [1, "two"], "loss_mask": [0, 1]},
     "malformed row: invalid literal for int()"),
]
N_GOOD = 20


@pytest.fixture(scope="module")
def corpus(tiny_target, tmp_path_factory):
    """One prepare over 20 good rows followed by one row of every bad kind."""
    from eagle3_pipeline.prepare.stage import prepare

    d = tmp_path_factory.mktemp("corpus")
    src = write_jsonl(d / "rows.jsonl", [good_row(i) for i in range(N_GOOD)] + [r for _, r, _ in ROWS])
    res = prepare(PrepareConfig(sources=[SourceConfig(path=str(src))], max_length=64, heldout_rows=2),
                  TargetConfig(model=str(tiny_target)), d / "store", log=lambda m: None)
    q = {r["row"]: r for r in map(json.loads, Path(res.quarantine).read_text().splitlines())}
    return res, src, q


@pytest.mark.parametrize("i", range(len(ROWS)), ids=[k for k, _, _ in ROWS])
def test_bad_row_is_quarantined_with_its_reason(corpus, i):
    res, src, q = corpus
    kind, row, why = ROWS[i]
    entry = q.get(N_GOOD + i)
    assert entry is not None, f"{kind}: row {N_GOOD + i} not quarantined"
    assert entry["source"] == str(src)
    assert why.format(src=src) in entry["reason"], (kind, entry["reason"])
    assert entry["raw"] is not None or kind == "duplicate id"  # the row itself is kept for inspection


def test_corpus_keeps_the_good_rows_and_the_invariant(corpus):
    from eagle3_pipeline.data.tokenized import load_tokenized

    res, _, q = corpus
    assert res.rows_in == N_GOOD + len(ROWS) == res.rows_out + res.rows_heldout + res.rows_quarantined
    assert res.rows_quarantined == len(ROWS) and sorted(q) == list(range(N_GOOD, N_GOOD + len(ROWS)))
    kept = set(load_tokenized(res.tokenized)["sample_id"]) | {
        json.loads(h)["sample_id"] for h in Path(res.heldout).read_text().splitlines()}
    assert kept == {f"g{i}" for i in range(N_GOOD)}  # every good row, the first g3 included, and only those


def _tokenizer_without_template(tiny_target: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / name, dst / name)
    return dst


def test_missing_chat_template_fails_naming_tokenizer_and_row(tiny_target, tmp_path):
    from eagle3_pipeline.prepare.stage import prepare

    tok = _tokenizer_without_template(tiny_target, tmp_path / "tok")
    src = write_jsonl(tmp_path / "a.jsonl", [good_row(i) for i in range(3)])
    target = TargetConfig(model=str(tiny_target), tokenizer=str(tok))
    with pytest.raises(InputError) as ei:
        prepare(PrepareConfig(sources=[SourceConfig(path=str(src))]), target, tmp_path / "store", log=lambda m: None)
    assert f"tokenizer {tok}: no chat template" in str(ei.value) and f"{src} row 0" in str(ei.value)
    assert exit_code(ei.value) == 3
    # pre-tokenized rows need no template: the same tokenizer prepares them
    pre = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "input_ids": [5, 6, 7 + i], "loss_mask": [0, 1, 1]}
                                             for i in range(4)])
    res = prepare(PrepareConfig(sources=[SourceConfig(path=str(pre))], heldout_rows=0), target, tmp_path / "s2",
                  log=lambda m: None)
    assert res.rows_out == 4


def test_no_usable_row_fails_and_keeps_the_quarantine(tiny_target, tmp_path):
    from eagle3_pipeline.prepare.stage import prepare

    src = write_jsonl(tmp_path / "bad.jsonl", [r for _, r, _ in ROWS[:6]])
    with pytest.raises(InputError) as ei:
        prepare(PrepareConfig(sources=[SourceConfig(path=str(src))]), TargetConfig(model=str(tiny_target)),
                tmp_path / "store", log=lambda m: None)
    msg = str(ei.value)
    assert "prepare: no usable rows: the sources hold 6 rows, all quarantined" in msg and "quarantine.jsonl" in msg
    qfile = Path(msg.split("see ")[-1])
    assert len(qfile.read_text().splitlines()) == 6
    assert not (qfile.parent / "prepare.json").exists()  # the version is not marked complete


def _csv(d: Path) -> Path:
    (d / "data.csv").write_text("a,b\n")
    return d / "data.csv"


def _dir_without_data(d: Path) -> Path:
    (d / "dir").mkdir()
    (d / "dir" / "notes.txt").write_text("x")
    return d / "dir"


SOURCE_CASES = {  # kind: (how to make the source under tmp_path, fragment of the error)
    "empty file": (lambda d: write_jsonl(d / "empty.jsonl", []), "no usable rows: the sources hold 0 rows"),
    "unsupported file type": (_csv, "data.csv: unsupported file type (expected .jsonl, .json, .parquet)"),
    "directory without data files": (_dir_without_data, "dir: no .jsonl/.json/.parquet files inside"),
    "missing path": (lambda d: d / "nope.jsonl", "nope.jsonl does not exist"),
}


@pytest.mark.parametrize("kind", SOURCE_CASES)
def test_unusable_source_is_a_clear_input_error(tiny_target, tmp_path, kind):
    from eagle3_pipeline.prepare.stage import prepare

    make, fragment = SOURCE_CASES[kind]
    src = make(tmp_path)
    with pytest.raises(InputError) as ei:
        prepare(PrepareConfig(sources=[SourceConfig(path=str(src))]), TargetConfig(model=str(tiny_target)),
                tmp_path / "store", log=lambda m: None)
    assert fragment in str(ei.value), str(ei.value)
    assert exit_code(ei.value) == 3


def test_damaged_json_file_stops_or_keeps_its_complete_records(tiny_target, tmp_path):
    """A JSON array cut part-way: by default prepare stops naming the file, the byte offset and the complete
    records before it; with on_damaged: keep_complete those records are prepared, the tail is one
    quarantined row with the offsets, and prepare.json records the loss."""
    from eagle3_pipeline.data.formats import DamagedSource
    from eagle3_pipeline.prepare.stage import prepare

    good = write_jsonl(tmp_path / "good.jsonl", [good_row(i) for i in range(6)])
    text = json.dumps([good_row(10 + i) for i in range(3)])
    cut = text[: text.rindex('"content"')]  # inside the last record
    broken = tmp_path / "broken.json"
    broken.write_text(cut)

    def run(on_damaged):
        return prepare(PrepareConfig(sources=[SourceConfig(path=str(good)),
                                              SourceConfig(path=str(broken), on_damaged=on_damaged)],
                                     heldout_rows=0), TargetConfig(model=str(tiny_target)), tmp_path / "store",
                       log=lambda m: None)

    with pytest.raises(DamagedSource) as e:
        run("error")
    msg = str(e.value)
    assert msg.startswith(f"damaged file {broken}: the file ends inside a record: it is truncated at byte "), msg
    assert f"of {len(cut):,}; 2 complete records precede it" in msg and "on_damaged: keep_complete" in msg, msg
    res = run("keep_complete")
    assert res.rows_in == 6 + 3 and res.rows_out == 6 + 2 and res.rows_quarantined == 1
    q = [json.loads(x) for x in Path(res.quarantine).read_text().splitlines()]
    assert [(r["source"], r["row"]) for r in q] == [(str(broken), 2)]
    assert q[0]["reason"].startswith(f"damaged file {broken}: ")
    [d] = res.damaged_sources
    assert d["records_complete"] == 2 and d["size"] == len(cut) and d["bytes_lost"] == len(cut) - d["good_end"] > 0
    assert res.source_warnings and "does not end with ']'" in res.source_warnings[0]


def test_bad_data_through_the_cli_exits_3(tiny_target, tmp_path):
    cfg = write_config(tmp_path, tiny_target, tmp_path / "missing.jsonl")
    res = cli_in_process("prepare", "-c", str(cfg))
    assert res.returncode == 3, res.stderr
    assert error_line(res.stderr) == (f"eagle3 prepare: error 3 (input): SourceError: dataset source "
                                      f"{tmp_path / 'missing.jsonl'} does not exist")


# -------------------------------------------------------------------------- model and tokenizer

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_variant(tiny_target: Path, dst: Path, drop: tuple[str, ...] = (), config: dict | str | None = None,
                  weights: bool = True) -> Path:
    """A copy of the tiny target's small files (weights linked) with one thing broken."""
    dst.mkdir()
    for name in MODEL_FILES:
        if name not in drop:
            shutil.copy(tiny_target / name, dst / name)
    if config is not None:
        (dst / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (dst / "model.safetensors").symlink_to(tiny_target / "model.safetensors")
    return dst


def _cfg_with(tiny_target, key: str, drop=None):
    cfg = json.loads((tiny_target / "config.json").read_text())
    cfg.update(key)
    for k in drop or ():
        del cfg[k]
    return cfg


MODEL_CASES = {  # kind: (model_variant kwargs builder, extract.layer_ids or None, fragments of PreflightFailed)
    "layer id out of range": (lambda t: {}, [2, 8], ["layer ids [2, 8]: [8] out of range [0, 7] for a 8-layer model"]),
    "negative layer id": (lambda t: {}, [-1, 4], ["[-1] out of range [0, 7]"]),
    "duplicate layer ids": (lambda t: {}, [2, 2, 5], ["layer ids [2, 2, 5]: duplicates"]),
    "unsorted layer ids": (lambda t: {}, [5, 2, 6], ["layer ids [5, 2, 6]: must be ascending"]),
    "tokenizer larger than the model's vocab": (lambda t: {"config": _cfg_with(t, {"vocab_size": 500})}, None,
                                               ["has 908 tokens but the model config of", "vocab_size 500",
                                                "token ids >= 500 have no embedding"]),
    "model dir without weights": (lambda t: {"weights": False}, None, ["no weight files (*.safetensors, *.bin",
                                                                      "found ['chat_template.jinja', 'config.json'"]),
    "model dir without config.json": (lambda t: {"drop": ("config.json",)}, None,
                                      ["model config of", "unreadable", "no config.json (found ["]),
    "config.json that is not JSON": (lambda t: {"config": "{'not': json"}, None, ["config.json: not valid JSON"]),
    "config.json without layer count": (lambda t: {"config": _cfg_with(t, {}, ["num_hidden_layers"])}, None,
                                        ["model config has no ['num_hidden_layers']; cannot place layer ids"]),
    "tokenizer dir that is not a tokenizer": (lambda t: {"drop": ("tokenizer.json", "tokenizer_config.json")}, None,
                                              ["cannot be loaded ("]),
}


@pytest.fixture()
def no_api_probe(monkeypatch):
    """Preflight's import probe of vLLM/speculators APIs costs ~10 s of imports and is not what these
    cases check; everything else in preflight runs for real."""
    import eagle3_pipeline.preflight.stage as pf

    monkeypatch.setattr(pf, "REQUIRED_APIS", {})


@pytest.mark.parametrize("kind", MODEL_CASES)
def test_model_problem_fails_preflight_naming_it(tiny_target, tmp_path, no_api_probe, kind):
    from eagle3_pipeline.preflight.stage import PreflightFailed, preflight

    make, layer_ids, fragments = MODEL_CASES[kind]
    model = model_variant(tiny_target, tmp_path / "model", **make(tiny_target))
    ovs = [f"store={tmp_path / 'store'}", f"target.model={model}"]
    if layer_ids is not None:
        ovs.append(f"extract.layer_ids={layer_ids}")
    cfg = load_config(TINY_YAML, ovs)
    with pytest.raises(PreflightFailed) as ei:
        preflight(cfg, 1000, tmp_path, log=lambda m: None)
    msg = str(ei.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert exit_code(ei.value) == ExitCode.ENVIRONMENT == 5


def test_the_unbroken_variant_passes_preflight(tiny_target, tmp_path, no_api_probe):
    """The control for the table above: the copy itself is a good model."""
    from eagle3_pipeline.preflight.stage import preflight

    model = model_variant(tiny_target, tmp_path / "model")
    cfg = load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={model}"])
    assert preflight(cfg, 1000, tmp_path, log=lambda m: None).layer_ids == LAYER_IDS


def test_disk_estimate_larger_than_free_space(tiny_target, tmp_path, no_api_probe, monkeypatch):
    from eagle3_pipeline.preflight.stage import PreflightFailed, preflight

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10 << 20))  # 10 MiB free
    cfg = load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={tiny_target}"])
    with pytest.raises(PreflightFailed, match=r"disk: offline bf16 needs about 0\.0[0-9] GiB of hidden states, "
                                              r"0\.01 GiB free at .*; neither fp8 storage nor online training fits"):
        preflight(cfg, 50_000, tmp_path / "store" / "x", log=lambda m: None)  # 50k tokens x 4 x 128 x 2 B = 51 MB


def test_disk_plans_offline_bf16_fp8_and_online(tiny_target, tmp_path, no_api_probe, monkeypatch):
    """Preflight compares the three ways of holding hidden states and checks the one this run uses: online
    keeps only the verified sample and the rows in flight, so it fits where the stored dataset does not."""
    from eagle3_pipeline.preflight.stage import PreflightFailed, disk_plans, preflight

    cfg = load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={tiny_target}"])
    plans = disk_plans(cfg, 4, 128, 1_000_000)
    assert plans["offline bf16"] == int(1_000_000 * (4 * 128 * 2 + 8) * 1.05)
    assert plans["offline fp8"] == int(1_000_000 * (4 * 128 + 12) * 1.05)
    online_tokens = (cfg.verify.online_rows + min(cfg.extract.max_num_seqs, 16) + 8) * cfg.prepare.max_length
    assert plans["online"] == int(online_tokens * (4 * 128 * 2 + 8) * 1.05) < plans["offline fp8"]
    assert disk_plans(cfg, 4, 128, 100)["online"] == int(100 * (4 * 128 * 2 + 8) * 1.05)  # never more than offline

    real = shutil.disk_usage
    free = plans["online"] + (1 << 20)  # room for online only
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    lines: list[str] = []
    with pytest.raises(PreflightFailed, match=r"offline bf16 needs about .*; what fits: online \("):
        preflight(cfg, 1_000_000, tmp_path / "store" / "x", log=lines.append)
    assert any("fits: online (this run: offline bf16)" in m for m in lines), lines
    online = load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={tiny_target}", "train.mode=online"])
    res = preflight(online, 1_000_000, tmp_path / "store" / "x", log=lambda m: None)
    assert res.estimated_bytes == plans["online"] and set(res.disk_plans) == {"offline bf16", "offline fp8", "online"}


def test_window_mode_states_the_window_and_refuses_what_cannot_run(tiny_target, tmp_path, no_api_probe):
    """train.mode window: preflight states the window's bytes against the dataset's (the store holds the window,
    not the dataset) and refuses a window_bytes below one shard; the config refuses a window below 2 shards and a
    topology the window's sampler cannot feed."""
    from eagle3_pipeline.core.errors import ConfigError
    from eagle3_pipeline.preflight.stage import PreflightFailed, preflight

    base = [f"store={tmp_path / 'store'}", f"target.model={tiny_target}", "train.mode=window"]
    per = 4 * 128 * 2 + 8
    lines: list[str] = []
    cfg = load_config(TINY_YAML, base + ["extract.rows_per_shard=4", "train.window_shards=3"])
    res = preflight(cfg, 1_000_000, tmp_path / "store" / "x", log=lines.append)
    shard = int(4 * cfg.prepare.max_length * per * 1.05)
    val = int(1_000_000 * cfg.train.val_ratio * per * 1.05)
    assert res.estimated_bytes == res.disk_plans["window"] == 3 * shard + val < res.disk_plans["offline bf16"]
    said = next(m for m in lines if "train.mode window" in m)
    assert "the store holds the window, not the dataset: at most 3 shards" in said, said
    assert any("fits:" in m and "(this run: window)" in m for m in lines), lines
    small = load_config(TINY_YAML, base + ["extract.rows_per_shard=4", f"train.window_bytes={shard - 1}"])
    with pytest.raises(PreflightFailed, match=r"train.window_bytes .* is less than one shard may take"):
        preflight(small, 1_000_000, tmp_path / "store" / "x", log=lambda m: None)
    with pytest.raises(ConfigError, match="window_shards"):
        load_config(TINY_YAML, base + ["train.window_shards=1"])
    two = load_config(TINY_YAML, base + ["train.world_size=2"])
    assert "train.mode=window trains in one process" in two.train.topology_problem()
    with pytest.raises(PreflightFailed, match="train.mode=window trains in one process"):
        preflight(two, 1_000_000, tmp_path / "store" / "x", log=lambda m: None)


def test_bad_layer_ids_through_the_cli_exit_5(tiny_target, tmp_path, no_api_probe):
    src = write_jsonl(tmp_path / "a.jsonl", [good_row(i) for i in range(6)])
    cfg = write_config(tmp_path, tiny_target, src, "extract.layer_ids=[2, 9, 5]")
    res = cli_in_process("extract", "-c", str(cfg))
    assert res.returncode == 5, res.stderr
    line = error_line(res.stderr)
    assert line == "eagle3 extract: error 5 (environment): PreflightFailed: preflight failed:"
    detail = res.stderr.split(line, 1)[1].splitlines()  # the message's further lines, indented
    assert "layer ids [2, 9, 5]: [9] out of range [0, 7] for a 8-layer model" in [d.strip() for d in detail]


# ----------------------------------------------------------------------- hidden-state records

@pytest.fixture(scope="module")
def tokenized(corpus) -> tuple[Path, list[list[int]]]:
    from eagle3_pipeline.data.tokenized import load_tokenized

    res = corpus[0]
    ds = load_tokenized(res.tokenized)
    return Path(res.tokenized), [ds[i]["input_ids"] for i in range(3)]


def record(ids: list[int], seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    scale = torch.arange(1, len(LAYER_IDS) + 1, dtype=torch.float32).view(1, -1, 1)
    hs = torch.randn(len(ids), len(LAYER_IDS), HIDDEN, generator=g) * scale  # [T, L, H]
    return {"token_ids": torch.tensor(ids, dtype=torch.int64), "hidden_states": hs.to(torch.bfloat16)}


def _nan(r):
    r["hidden_states"][2, 1, 7] = float("nan")
    return r


def _zero_last_layer(r):
    r["hidden_states"][:, 3] = 0
    return r


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _big_header(p: Path):
    blob = p.read_bytes()
    p.write_bytes((10 ** 9).to_bytes(8, "little") + blob[8:])


RECORD_CASES = {  # kind: (change to record 1 or its file, fragment; {T} = the row's length)
    "truncated file": (("file", _truncate), "unreadable (ValueError: tensor 'hidden_states': data_offsets"),
    "empty file": (("file", lambda p: p.write_bytes(b"")), "unreadable (ValueError: 0 bytes: shorter than the 8-byte header"),
    "header longer than the file": (("file", _big_header), "header of 1000000000 bytes does not fit in the file"),
    "file missing": (("file", lambda p: p.unlink()), "file missing"),
    "NaN value": (("rec", _nan), "layer 4: 1 non-finite values (first at token 2)"),
    "all-zero layer": (("rec", _zero_last_layer), "layer 8: all zeros"),
    "wrong dtype": (("rec", lambda r: {**r, "hidden_states": r["hidden_states"].half()}),
                    "hidden_states dtype expected torch.bfloat16, found torch.float16"),
    "wrong hidden size": (("rec", lambda r: {**r, "hidden_states": r["hidden_states"][..., :64].contiguous()}),
                          "hidden_states expected [{T}, 4, 128], found [{T}, 4, 64]"),
    "layer missing": (("rec", lambda r: {**r, "hidden_states": r["hidden_states"][:, :3].contiguous()}),
                      "found [{T}, 3, 128] (3 layers captured, 4 configured: ids [2, 4, 5, 8])"),
    "rank 2 instead of 3": (("rec", lambda r: {**r, "hidden_states": r["hidden_states"][:, 0].contiguous()}),
                            "found [{T}, 128] (rank 2, expected rank 3 [T, L, H])"),
    "token ids of the wrong dtype": (("rec", lambda r: {**r, "token_ids": r["token_ids"].int()}),
                                     "token_ids expected int64 [{T}], found int32 [{T}]"),
    "token ids of another row": (("rec", lambda r: {**r, "token_ids": r["token_ids"].flip(0).contiguous()}),
                                 "token_ids differ from the tokenized row from position 0"),
    "key missing": (("rec", lambda r: {"hidden_states": r["hidden_states"]}), "key 'token_ids' missing (found ['hidden_states'])"),
}


@pytest.mark.parametrize("kind", RECORD_CASES)
def test_bad_record_is_named_by_verify(tokenized, tmp_path, kind):
    from safetensors.torch import save_file

    from eagle3_pipeline.verify.structure import StructureCheck, verify_structure

    tok_dir, ids = tokenized
    (where, change), fragment = RECORD_CASES[kind]
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for i, row in enumerate(ids):
        rec = record(row, seed=i)
        save_file(change(rec) if (where == "rec" and i == 1) else rec, str(hs / f"hs_{i}.safetensors"))
    if where == "file":
        change(hs / "hs_1.safetensors")
    res = verify_structure(StructureCheck(tok_dir, hs, LAYER_IDS, HIDDEN), rows=[0, 1, 2], log=lambda m: None)
    assert not res.passed and res.bad_rows == [1], res.problems
    assert all(p.startswith("hs_1.safetensors (row 1, sample ") for p in res.problems), res.problems
    assert any(fragment.format(T=len(ids[1])) in p for p in res.problems), res.problems


def test_good_records_pass_and_a_stray_file_is_named(tokenized, tmp_path):
    """The control for the table above (the synthetic records are good), plus a file with no row."""
    from safetensors.torch import save_file

    from eagle3_pipeline.verify.structure import StructureCheck, verify_structure

    tok_dir, ids = tokenized
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for i, row in enumerate(ids):
        save_file(record(row, seed=i), str(hs / f"hs_{i}.safetensors"))
    assert verify_structure(StructureCheck(tok_dir, hs, LAYER_IDS, HIDDEN), rows=[0, 1, 2], log=lambda m: None).passed
    save_file(record(ids[0]), str(hs / "hs_999.safetensors"))
    res = verify_structure(StructureCheck(tok_dir, hs, LAYER_IDS, HIDDEN), rows=[0, 1, 2], log=lambda m: None)
    assert not res.passed and res.problems[0].startswith("hs_999.safetensors: no tokenized row 999 (dataset has ")


# ------------------------------------------------------------------------------ vocab inputs

@pytest.mark.parametrize("kind,counts,fragment", [
    ("2-D counts", [[1, 2], [3, 4]], "'counts' expected shape [908], found [2, 2]"),
    ("counts beyond the vocab", [0] * 908 + [5], "counts for ids >= target vocab size 908 (e.g. id 908)"),
    ("negative count", [0, -3, 1], "negative count for id 1"),
])
def test_bad_token_frequencies(tmp_path, kind, counts, fragment):
    import numpy as np
    from safetensors.numpy import save_file

    from eagle3_pipeline.records.vocab import VocabError
    from eagle3_pipeline.vocab.stage import read_token_freq

    path = tmp_path / "token_freq.safetensors"
    save_file({"counts": np.asarray(counts, dtype=np.int64)}, str(path))
    with pytest.raises(VocabError) as ei:
        read_token_freq(path, 908)
    assert str(ei.value).startswith(f"token frequencies {path}: ") and fragment in str(ei.value)
    assert exit_code(ei.value) == 3


# -------------------------------------------------------------------------------- disk full

def _limit_file_size(n: int):
    """For a child: files larger than n bytes cannot be written (EFBIG; SIGXFSZ ignored)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return apply


ATOMIC_CHILD = """
import json, sys
from pathlib import Path
from eagle3_pipeline.core.store import write_json
try:
    write_json(Path(sys.argv[1]), {"rows": list(range(5000))})
except Exception as e:
    print(json.dumps({"type": type(e).__name__, "msg": str(e), "errno": getattr(e, "errno", None),
                      "code": __import__("eagle3_pipeline.core.errors").core.errors.exit_code(e)}))
"""


def test_disk_full_on_an_atomic_write_leaves_nothing_under_the_final_name(tmp_path):
    target = tmp_path / "out" / "manifest.json"
    res = subprocess.run([sys.executable, "-c", ATOMIC_CHILD, str(target)], capture_output=True, text=True,
                         timeout=120, preexec_fn=_limit_file_size(4096))
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["type"] == "DiskFull" and out["errno"] == errno.EFBIG and out["code"] == 5, out
    assert out["msg"].startswith(f"{target}: write failed, the disk is full (OSError: [Errno 27] File too large")
    assert list((tmp_path / "out").iterdir()) == []  # neither the final name nor the temporary file


@pytest.fixture()
def small_disk(tmp_path):
    """A real, nearly full filesystem: a 64 KiB tmpfs with 8 KiB left (room for lock files, not for the
    first data file). Skips where the machine does not let us mount one (no CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("cannot mount a tmpfs here; the file-size-limit case covers disk full")
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            os.write(fd, b"\0" * (56 << 10))
        finally:
            os.close(fd)
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)  # never leave it mounted


def open_files_under(path: Path) -> list[str]:
    """Files under `path` this process still has open (a leaked handle of a failed write keeps a
    deleted temporary file's space in use until the process exits)."""
    fds = Path("/proc/self/fd")
    links = [os.readlink(fds / fd) for fd in os.listdir(fds) if (fds / fd).is_symlink()]
    return [ln for ln in links if ln.startswith(str(path))]


@pytest.mark.parametrize("how", ["file-size limit", "full tmpfs"])
def test_disk_full_during_prepare_through_the_cli_exits_5(tiny_target, tmp_path, request, how):
    """The first data file prepare writes does not fit: EFBIG under a file-size limit (works anywhere),
    ENOSPC on a real full filesystem (where a tmpfs can be mounted)."""
    src = write_jsonl(tmp_path / "a.jsonl", [good_row(i) for i in range(40)])
    store = (request.getfixturevalue("small_disk") if how == "full tmpfs" else tmp_path) / "store"
    cfg = write_config(tmp_path, tiny_target, src, f"store={store}")
    if how == "file-size limit":  # a limit of the process: the real console script in a child
        res = cli("prepare", "-c", str(cfg), preexec_fn=_limit_file_size(1024))
    else:
        res = cli_in_process("prepare", "-c", str(cfg))
        assert open_files_under(store) == []
    assert res.returncode == 5, res.stderr
    line = error_line(res.stderr)
    assert line.startswith(f"eagle3 prepare: error 5 (environment): DiskFull: {store}/") and "the disk is full" in line
    assert ("File too large" if how == "file-size limit" else "No space left on device") in line
    written = [p for p in store.rglob("*") if p.is_file()]
    assert not [p for p in written if ".tmp" in p.name]  # no temporary file left behind
    assert not [p for p in written if p.name == "prepare.json"]  # the version is not marked complete
    for p in written:  # whatever is under a final name is complete
        if p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".parquet":
            pq.read_table(p)


# ------------------------------------------------------------------------------ exit codes

def _chain(outer: type[BaseException], inner: BaseException, suppress: bool = False) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            if suppress:
                raise outer("wrapper") from None
            raise outer("wrapper")  # implicit __context__, as an orchestrator re-raising would leave
    except BaseException as e:
        return e


def _exit_code_cases():
    from eagle3_pipeline.core.proc import ChildFailed, ChildTimedOut
    from eagle3_pipeline.data.formats import SourceError
    from eagle3_pipeline.evaluate.results import EvaluateError
    from eagle3_pipeline.evaluate.stage import EvaluateGateFailed, InvalidDraftError
    from eagle3_pipeline.extract.stage import ExtractFailed
    from eagle3_pipeline.gpu.stage import GpuGateFailed
    from eagle3_pipeline.preflight.stage import PreflightFailed
    from eagle3_pipeline.records.contracts import ContractError
    from eagle3_pipeline.records.vocab import VocabError
    from eagle3_pipeline.train.export import ExportCheckError

    timed_out = ChildTimedOut("evaluate ran past its deadline of 60s")
    evaluate_wrapped = EvaluateError("evaluate: child failed")
    evaluate_wrapped.__cause__ = timed_out
    return {
        "ConfigError": (ConfigError("x"), 2), "ContractError": (ContractError("x"), 3), "SourceError": (SourceError("x"), 3),
        "VocabError": (VocabError("x"), 3), "InvalidDraftError": (InvalidDraftError("x"), 3),
        "VerifyFailed": (VerifyFailed("x"), 4), "EvaluateGateFailed": (EvaluateGateFailed("x"), 4),
        "ExportCheckError": (ExportCheckError("x"), 4), "PreflightFailed": (PreflightFailed("x"), 5),
        "GpuGateFailed": (GpuGateFailed("x"), 5), "DiskFull": (DiskFull("x"), 5),
        "OSError ENOSPC": (OSError(errno.ENOSPC, "No space left on device"), 5), "ChildTimedOut": (timed_out, 6),
        "TimeoutError": (TimeoutError("flow run exceeded timeout"), 6), "KeyboardInterrupt": (KeyboardInterrupt(), 130),
        "ChildFailed": (ChildFailed("exited with code 1"), 1), "ExtractFailed": (ExtractFailed("x"), 1),
        "ValueError": (ValueError("x"), 1),
        "EvaluateError caused by a timeout": (evaluate_wrapped, 6),
        "RuntimeError wrapping VerifyFailed": (_chain(RuntimeError, VerifyFailed("bad shard")), 4),
        "wrapper from None hides the context": (_chain(RuntimeError, VerifyFailed("bad shard"), suppress=True), 1),
        "group holding a gate failure": (ExceptionGroup("tasks", [ValueError("a"), VerifyFailed("b")]), 4),
    }


def test_every_category_has_its_exit_code():
    cases = _exit_code_cases()
    got = {k: exit_code(e) for k, (e, _) in cases.items()}
    assert got == {k: code for k, (_, code) in cases.items()}
    assert isinstance(cases["ContractError"][0], ValueError) and isinstance(cases["VerifyFailed"][0], RuntimeError)
    assert isinstance(cases["ChildTimedOut"][0], StageTimeout) and isinstance(cases["DiskFull"][0], OSError)
    assert issubclass(type(cases["ExportCheckError"][0]), GateFailed)


def test_cli_error_line_names_the_culprit_and_the_wrapper(capsys):
    import typer

    from flows.cli import fail

    wrapped = _chain(RuntimeError, VerifyFailed("verify failed: 2 problems\n  hs_3: layer 2 expected [5, 128], found [5]"))
    with pytest.raises(typer.Exit) as ei:
        fail("run", wrapped)
    assert ei.value.exit_code == 4
    err = capsys.readouterr().err.splitlines()
    assert err == ["eagle3 run: error 4 (gate): VerifyFailed: verify failed: 2 problems",
                   "      hs_3: layer 2 expected [5, 128], found [5]",
                   "  raised as RuntimeError: wrapper"]


def test_interrupt_in_a_command_exits_130(monkeypatch):
    import flows.cli as cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config", interrupted)  # the command's first call
    res = cli_in_process("prepare", "-c", str(TINY_YAML))
    assert res.returncode == 130 and error_line(res.stderr) == "eagle3 prepare: error 130 (interrupted): KeyboardInterrupt"


def test_prefect_termination_and_cancellation_codes():
    from prefect.exceptions import CancelledRun, TerminationSignal

    from flows.cli import _prefect_code

    term = TerminationSignal(signal.SIGTERM)
    assert exit_code(_chain(RuntimeError, term), _prefect_code) == 128 + signal.SIGTERM == 143
    assert exit_code(CancelledRun("cancelled in the UI"), _prefect_code) == 130


def test_status_without_runs_exits_1(tmp_path):
    res = cli("status", "--output-dir", str(tmp_path / "runs"))
    assert res.returncode == 1 and f"no run yet under {tmp_path / 'runs'}" in res.stdout


def test_fp8_records_are_the_default_from_hidden_size_4096():
    """extract.storage_dtype auto resolves by the target's hidden size; an explicit setting wins; the reason says which."""
    from eagle3_pipeline.records.contracts import ContractError, storage_dtype_for

    assert storage_dtype_for("auto", 7168)[0] == "fp8" and storage_dtype_for("auto", 4096)[0] == "fp8"
    dtype, why = storage_dtype_for("auto", 4095)
    assert dtype == "bf16" and "hidden size < 4096 (this one: 4095)" in why
    assert storage_dtype_for("bf16", 7168) == ("bf16", "extract.storage_dtype bf16 (set in the config)")
    assert storage_dtype_for("fp8", 64)[0] == "fp8"
    with pytest.raises(ContractError, match="expected 'auto', 'bf16' or 'fp8'"):
        storage_dtype_for("fp16", 64)
    assert load_config(TINY_YAML).extract.storage_dtype == "auto"  # no config states bf16 unless it means it
    for name in ("kimi-k2.5-tp8", "deepseek-v3-tp8"):  # hidden 7168 both: fp8 records unless a config says otherwise
        assert load_config(TINY_YAML.parent / f"{name}.yaml").extract.storage_dtype == "auto"


def test_preflight_resolves_the_storage_dtype_from_the_target_and_refuses_what_the_store_cannot_hold(
        tiny_target, tmp_path, no_api_probe, monkeypatch):
    """A target with hidden size 4096 gets fp8 records by default: preflight says so and why, sizes the store by it,
    and the extract version it plans writes fp8. With bf16 stated, the same free space refuses the run and names fp8
    as what fits."""
    from eagle3_pipeline.preflight.stage import PreflightFailed, disk_plans, preflight, record_bytes_per_token

    wide = model_variant(tiny_target, tmp_path / "wide", config=_cfg_with(tiny_target, {"hidden_size": 4096}))
    over = [f"store={tmp_path / 'store'}", f"target.model={wide}"]
    lines: list[str] = []
    tokens = 200_000
    plans = disk_plans(load_config(TINY_YAML, over), 4, 4096, tokens)
    real = shutil.disk_usage
    free = (plans["offline fp8"] + plans["offline bf16"]) // 2  # room for fp8 records, not for bf16
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    res = preflight(load_config(TINY_YAML, over), tokens, tmp_path / "store" / "x", log=lines.append)
    assert res.storage_dtype == "fp8" and "hidden size >= 4096 (this one: 4096)" in res.storage_reason
    assert res.estimated_bytes == plans["offline fp8"] and res.bytes_per_token == 4 * 4096 + 12
    assert any("records: extract.storage_dtype auto: fp8" in m for m in lines), lines
    assert any(f"records take {4 * 4096 + 12:,} B/token (fp8: 4 layers x 4096 hidden)" in m for m in lines), lines
    with pytest.raises(PreflightFailed, match=r"disk: offline bf16 needs about .*; what fits: offline fp8"):
        preflight(load_config(TINY_YAML, over + ["extract.storage_dtype=bf16"]), tokens, tmp_path / "store" / "x",
                  log=lambda m: None)
    narrow = preflight(load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={tiny_target}"]), tokens,
                       tmp_path / "store" / "x", log=lambda m: None)
    assert narrow.storage_dtype == "bf16" and narrow.bytes_per_token == record_bytes_per_token(4, 128, "bf16")


def test_preflight_states_the_write_bandwidth_of_the_extraction_topology(tiny_target, tmp_path, no_api_probe):
    """parallel_groups engines x one engine's prefill tokens/s x bytes per token; the Kimi figure of the issue
    (16 TP8 nodes of bf16 records, 56 KiB a token) is ~27 GB/s; unstated throughput is said to be unstated."""
    from eagle3_pipeline.preflight.stage import extract_write_rate, preflight, record_bytes_per_token

    kimi = load_config(TINY_YAML.parent / "kimi-k2.5-tp8.yaml",
                       ["extract.parallel_groups=16", "extract.engine_tokens_per_s=29000"])
    per = record_bytes_per_token(4, 7168, "bf16")
    assert per == 56 * 1024 + 8
    rate, line = extract_write_rate(kimi, per)
    assert rate == pytest.approx(26.6e9, rel=0.01) and "16 engine(s) (TP 8) x 29,000 tokens/s" in line
    assert extract_write_rate(kimi, record_bytes_per_token(4, 7168, "fp8"))[0] == pytest.approx(rate / 2, rel=0.01)
    lines: list[str] = []
    cfg = load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={tiny_target}",
                                  "extract.parallel_groups=2", "extract.engine_tokens_per_s=1000"])
    res = preflight(cfg, 1000, tmp_path / "store" / "x", log=lines.append)
    assert res.write_bytes_per_s == 2 * 1000 * res.bytes_per_token
    assert res.read_bytes_per_s == pytest.approx(res.estimated_bytes * cfg.train.epochs / cfg.train.timeout_s)
    assert any("extraction writes" in m and "2 engine(s)" in m for m in lines), lines
    assert any("training reads the store" in m for m in lines), lines
    lines.clear()
    plain = preflight(load_config(TINY_YAML, [f"store={tmp_path / 'store'}", f"target.model={tiny_target}"]), 1000,
                      tmp_path / "store" / "x", log=lines.append)
    assert plain.write_bytes_per_s is None and any("set extract.engine_tokens_per_s" in m for m in lines), lines


def test_the_planned_extraction_stores_the_dtype_preflight_resolved(tiny_config, prepared, preflighted):
    """The extract version (its records' dtype, its content key, its pool) is planned from preflight's resolved
    dtype, not from the config's `auto`: the tiny target (hidden 128) stores bf16; an fp8 resolution is another
    version."""
    from eagle3_pipeline.pipeline.stages import plan_extract

    assert tiny_config.extract.storage_dtype == "auto" and preflighted.storage_dtype == "bf16"
    bf = plan_extract(tiny_config, prepared, preflighted)
    fp = plan_extract(tiny_config, prepared, preflighted.model_copy(update={"storage_dtype": "fp8"}))
    assert (bf.storage_dtype, fp.storage_dtype) == ("bf16", "fp8")
    assert bf.content_key != fp.content_key and bf.pool_dir != fp.pool_dir
