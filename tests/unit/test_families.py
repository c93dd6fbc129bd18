"""Model families (records/families.py): each production config is recognised as the families it belongs to,
every reader of a family's difference (the one-layer config, KV bytes, head size, experts, logit transforms,
the fingerprint's blocker) reads FAMILIES, so a family added there is one entry, and docs/targets.md names
every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.records import families
from eagle3_pipeline.records.contracts import fingerprint_blocker, model_dims
from eagle3_pipeline.records.families import Family, families_of, kv_bytes_per_token, layer_config, text_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "model_configs"


@pytest.mark.parametrize("name, expected", [("kimi-k2.5", ["deepseek", "mla"]), ("deepseek-v3", ["deepseek", "mla"]),
                                            ("qwen3-8b", [])])
def test_production_configs_are_recognised(name, expected):
    text = text_config(json.loads((CONFIGS / name / "config.json").read_text()))
    assert [f.name for f in families_of(text)] == expected


def test_a_plain_decoder_is_no_family():
    llama = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 100}
    assert families_of(llama) == []
    assert kv_bytes_per_token(llama, 2, 1) == 4 * 2 * 2 * 16 * 2
    assert layer_config(llama, 2) == {**llama, "num_hidden_layers": 1, "vocab_size": 8, "pad_token_id": None,
                                      "use_cache": False}


def test_a_family_added_is_one_entry(monkeypatch, tmp_path):
    """A toy family in FAMILIES alone changes the one-layer config, the KV bytes and head size, the MoE flag,
    the logit transforms and the fingerprint's blocker: no other module names it."""
    toy = Family("toy", "a toy family: every other layer is wide", matches=lambda c: "toy_wide_every" in c,
                 one_layer=lambda text, k: {"toy_wide_every": 1 if k % int(text["toy_wide_every"]) == 0 else 0},
                 latent_kv=lambda c: (96, 80), experts=("toy_experts",), logit_keys=("toy_logit_scale",),
                 unmodelled_output="its output norm is not RMSNorm")
    text = {"model_type": "toy", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100,
            "toy_wide_every": 2, "toy_experts": 8, "toy_logit_scale": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(text))
    before = (layer_config(text, 1), kv_bytes_per_token(text, 2, 1), model_dims(tmp_path))
    assert before[0]["toy_wide_every"] == 2 and before[1] == 4 * 2 * 4 * 16 * 2
    assert not before[2].moe and before[2].head_dim == 16 and not before[2].mla

    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, toy))
    assert [f.name for f in families_of(text)] == ["toy"]
    assert [layer_config(text, k)["toy_wide_every"] for k in range(4)] == [1, 0, 1, 0]
    assert kv_bytes_per_token(text, 2, 8) == 4 * 96 * 2  # one latent vector per token and layer, on every rank
    dims = model_dims(tmp_path)
    assert dims.moe and dims.mla and dims.head_dim == 80
    assert families.logit_transform(tmp_path) == "its logits are transformed after lm_head ({'toy_logit_scale': 0.5})"
    assert families.unmodelled_output(text) == "model type toy: its output norm is not RMSNorm"

    class Target:
        model = str(tmp_path)

    assert fingerprint_blocker(Target(), dims) == "model type toy: its output norm is not RMSNorm"


def test_logit_transforms_and_gemma_block_the_fingerprint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"model_type": "cohere", "logit_scale": 0.0625}}))
    assert "logit_scale" in families.logit_transform(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "cohere", "logit_scale": 1.0}))
    assert families.logit_transform(tmp_path) is None  # a scale of 1 changes nothing
    assert families.unmodelled_output({"model_type": "gemma2"}) is not None
    assert families.unmodelled_output({"model_type": "llama"}) is None


def test_every_family_is_named_in_the_docs():
    doc = (ROOT / "docs" / "targets.md").read_text()
    assert "## Adding a model family" in doc
    section = doc.split("## Adding a model family", 1)[1].split("\n## ", 1)[0]
    missing = [f.name for f in families.FAMILIES if f"`{f.name}`" not in section]
    assert missing == [], f"docs/targets.md, 'Adding a model family', does not name {missing}"
