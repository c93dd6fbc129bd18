import json

import pytest

from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.core.errors import ConfigError
from eagle3_pipeline.core.store import atomic_write, atomic_write_text, content_key, write_json
from eagle3_pipeline.records.contracts import ContractError, resolve_layer_ids

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_real_configs_load_and_overrides_apply():
    for cfg_file in (ROOT / "configs").glob("*.yaml"):
        load_config(cfg_file)
    cfg = load_config(ROOT / "configs/tiny-cpu.yaml", ["train.epochs=7", "extract.layer_ids=[1, 3, 5]"])
    assert cfg.train.epochs == 7 and cfg.extract.layer_ids == [1, 3, 5]
    assert cfg.target.tokenizer == cfg.target.model


def test_config_typo_fails_loudly():
    with pytest.raises(ConfigError, match="train.epochz: unknown key"):
        load_config(ROOT / "configs/tiny-cpu.yaml", ["train.epochz=3"])
    with pytest.raises(ValueError, match="key=value"):
        load_config(ROOT / "configs/tiny-cpu.yaml", ["train.epochs"])


def test_content_key_is_order_independent_and_sensitive():
    assert content_key({"a": 1, "b": [1, 2]}) == content_key({"b": [1, 2], "a": 1})
    assert content_key({"a": 1}) != content_key({"a": 2})


def test_atomic_write_never_leaves_partial_file(tmp_path):
    target = tmp_path / "x.json"
    write_json(target, {"ok": 1})

    def boom(p):
        p.write_text('{"half": ')
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert json.loads(target.read_text()) == {"ok": 1}  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temp file left
    atomic_write_text(target, "new")
    assert target.read_text() == "new"


@pytest.mark.parametrize("n_layers,ids,expected", [
    (8, None, [2, 4, 5, 8]), (61, None, [2, 30, 58, 61]), (32, [3, 16, 29], [3, 16, 29, 32])])
def test_layer_ids_default_and_explicit(n_layers, ids, expected):
    assert resolve_layer_ids(n_layers, ids) == expected


@pytest.mark.parametrize("ids,msg", [([2, 2, 5], "duplicates"), ([5, 2], "ascending"), ([2, 8], "out of range"),
                                     ([-1, 3], "out of range"), ([], "at least one")])
def test_layer_ids_invalid(ids, msg):
    with pytest.raises(ContractError, match=msg):
        resolve_layer_ids(8, ids)


def test_train_key_follows_what_shapes_the_draft_only():
    """log_freq / timeout_s / num_workers resume the same checkpoint dir; lr or epochs start a new one."""
    from eagle3_pipeline.pipeline.stages import train_key
    from eagle3_pipeline.records.contracts import ModelDims
    from eagle3_pipeline.records.layout import ExtractVersion, plan_shards

    cfg = load_config(ROOT / "configs/tiny-cpu.yaml")
    version = ExtractVersion(content_key="abc", dir="/store/x/abc", prepare_version="p", tokenized_dir="/store/x/tok",
                             layer_ids=[2, 4, 5, 8], rows=8, rows_per_shard=4, shards=plan_shards(8, 4), groups=[[0, 1]],
                             dims=ModelDims(num_layers=8, hidden_size=128, vocab_size=1024, head_dim=32,
                                            model_type="llama"))
    base = train_key(cfg, version)
    for watch in ("train.log_freq=10", "train.timeout_s=60", "train.num_workers=2"):
        assert train_key(load_config(ROOT / "configs/tiny-cpu.yaml", [watch]), version) == base, watch
    for shape in ("train.lr=0.02", "train.epochs=2", "train.seed=1", "train.ttt_steps=2"):
        assert train_key(load_config(ROOT / "configs/tiny-cpu.yaml", [shape]), version) != base, shape
    assert train_key(cfg, version.model_copy(update={"content_key": "abd"})) != base
    # the window's keys change an offline run's key never, a window run's always (the blocks shape the order)
    assert train_key(load_config(ROOT / "configs/tiny-cpu.yaml", ["train.window_shards=4"]), version) == base
    win = train_key(load_config(ROOT / "configs/tiny-cpu.yaml", ["train.mode=window"]), version)
    assert win != base != train_key(load_config(ROOT / "configs/tiny-cpu.yaml", ["train.mode=window",
                                                                                "train.window_shards=4"]), version) != win
    other_k = cfg.vocab.draft_vocab_size // 2  # another vocab dir of the same version
    assert train_key(load_config(ROOT / "configs/tiny-cpu.yaml", [f"vocab.draft_vocab_size={other_k}"]), version) != base
