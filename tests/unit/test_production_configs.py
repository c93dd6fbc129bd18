"""Preflight facts of the users' production targets, read from checked-in config.json files (no
weights, no model load): nested text_config, MLA head size, MoE, default layer ids, and the
architecture's EAGLE-3 support in the installed vLLM's model registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.preflight.stage import architecture_problems
from eagle3_pipeline.records.contracts import ContractError, default_aux_layer_ids, model_dims, resolve_layer_ids

CONFIGS = Path(__file__).parents[1] / "data" / "model_configs"
REPO = Path(__file__).parents[2]


@pytest.mark.parametrize("name, n, hidden, vocab, mla, moe, aux", [
    ("kimi-k2.5", 61, 7168, 163840, True, True, [2, 30, 58]),
    ("deepseek-v3", 61, 7168, 129280, True, True, [2, 30, 58]),
    ("qwen3-8b", 36, 4096, 151936, False, False, [2, 18, 33]),
])
def test_model_dims_of_production_configs(name, n, hidden, vocab, mla, moe, aux):
    dims = model_dims(CONFIGS / name)
    assert (dims.num_layers, dims.hidden_size, dims.vocab_size, dims.mla, dims.moe) == (n, hidden, vocab, mla, moe)
    assert dims.head_dim == (576 if mla else 128)
    assert resolve_layer_ids(n, None) == aux + [n]


def test_kimi_wrapper_reads_the_text_model_not_the_vision_tower():
    raw = json.loads((CONFIGS / "kimi-k2.5" / "config.json").read_text())
    assert raw["vision_config"]["hidden_size"] != raw["text_config"]["hidden_size"]
    dims = model_dims(CONFIGS / "kimi-k2.5")
    assert dims.hidden_size == raw["text_config"]["hidden_size"] and dims.model_type == "kimi_k2"
    assert dims.architectures == ["KimiK25ForConditionalGeneration"]


@pytest.mark.parametrize("name", ["kimi-k2.5", "deepseek-v3", "qwen3-8b"])
def test_architecture_resolves_in_vllm_registry_with_eagle3(name):
    assert architecture_problems(model_dims(CONFIGS / name)) == []


def test_architecture_check_fails_for_unknown_and_non_eagle3_classes(tmp_path):
    cfg = json.loads((CONFIGS / "qwen3-8b" / "config.json").read_text())
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({**cfg, "architectures": ["NoSuchModelForCausalLM"]}))
    probs = architecture_problems(model_dims(tmp_path / "unknown"))
    assert len(probs) == 1 and "NoSuchModelForCausalLM" in probs[0] and "registry" in probs[0]
    # a registered class that does not implement SupportsEagle3 (an embedding/pooling model)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertModel"]}))
    probs = architecture_problems(model_dims(tmp_path / "bert"))
    assert len(probs) == 1 and "does not support EAGLE-3" in probs[0], probs


@pytest.mark.parametrize("n", range(1, 80))
def test_default_layer_ids_are_distinct_ascending_and_in_range_for_any_depth(n):
    aux = default_aux_layer_ids(n)
    assert aux == sorted(set(aux)) and all(0 <= a < n for a in aux) and len(aux) == min(3, max(1, n - 1))
    assert resolve_layer_ids(n, None) == aux + [n]  # never raises for the default
    if n >= 7:
        assert aux == [2, n // 2, n - 3]  # EAGLE-3's own choice where it fits


def test_small_depths_get_spread_ids():
    assert default_aux_layer_ids(6) == [1, 3, 5]
    assert default_aux_layer_ids(4) == [1, 2, 3]
    with pytest.raises(ContractError, match="duplicates"):
        resolve_layer_ids(6, [2, 3, 3])  # an explicit colliding list is still refused


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_checked_in_config_loads(path):
    cfg = load_config(path)
    assert cfg.name and cfg.prepare.sources


@pytest.mark.parametrize("config, model", [("kimi-k2.5-tp8", "kimi-k2.5"), ("deepseek-v3-tp8", "deepseek-v3"),
                                           ("qwen3-8b", "qwen3-8b")])
def test_preflight_of_production_configs_finds_only_the_missing_weights(config, model, tmp_path):
    """The production YAMLs against the real models' config.json (no weights here): preflight reads the
    dims and layer ids and resolves the architecture; it stops, in seconds, only on what is really
    missing — weights and tokenizer files — and lists them together."""
    from eagle3_pipeline.preflight.stage import PreflightFailed, preflight

    cfg = load_config(REPO / "configs" / f"{config}.yaml", [f"target.model={CONFIGS / model}", f"store={tmp_path}"])
    with pytest.raises(PreflightFailed) as e:
        preflight(cfg, tokens_estimate=1000, out_dir=tmp_path, log=lambda m: None)
    msg = str(e.value)
    assert "no weight files" in msg, msg
    assert "layer ids" not in msg and "architecture" not in msg and "MLA head size" not in msg, msg
