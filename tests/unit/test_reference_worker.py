"""Pieces of the streaming reference (verify/worker.py, verify/reference.py) that need no model run:
one-layer configs per architecture, the weight-prefix choice, raw safetensors copies, embedding rows,
and the pass/fail decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.core.config import VerifyConfig
from eagle3_pipeline.records.contracts import LayerDiff
from eagle3_pipeline.records.families import known_model_type, layer_config, text_config
from eagle3_pipeline.verify.reference import _row_problems
from eagle3_pipeline.verify.stage import _config_key
from eagle3_pipeline.verify.worker import CannotStream, Checkpoint


def test_deepseek_layer_is_dense_iff_the_full_models_layer_is():
    text = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "first_k_dense_replace": 3, "vocab_size": 163840,
            "pad_token_id": 163839, "num_nextn_predict_layers": 1}
    assert [layer_config(text, k)["first_k_dense_replace"] for k in (0, 2, 3, 60)] == [1, 1, 0, 0]
    one = layer_config(text, 5)
    assert one["num_hidden_layers"] == 1 and one["num_nextn_predict_layers"] == 0
    assert one["vocab_size"] == 8 and one["pad_token_id"] is None  # no 1 GB random embedding
    v2 = {**text, "first_k_dense_replace": 1, "moe_layer_freq": 2}  # DeepSeek-V2: MoE on every 2nd layer
    assert [layer_config(v2, k)["first_k_dense_replace"] for k in (0, 1, 2)] == [1, 1, 0]


def test_qwen_moe_and_per_layer_lists_are_sliced():
    text = {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3], "vocab_size": 10,
            "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "architectures": ["Qwen3MoeForCausalLM"]}
    got = [(layer_config(text, k)["mlp_only_layers"], layer_config(text, k)["layer_types"]) for k in range(4)]
    # sparse iff (k + 1) % 2 == 0 and k not in [3]: only layer 1
    assert got == [([0], ["full_attention"]), ([], ["sliding_attention"]), ([0], ["full_attention"]),
                   ([0], ["sliding_attention"])]
    assert layer_config(text, 1)["architectures"] == ["Qwen3MoeForCausalLM"]
    qwen2 = {"num_hidden_layers": 4, "max_window_layers": 2, "vocab_size": 10}
    assert [layer_config(qwen2, k)["max_window_layers"] for k in range(4)] == [1, 1, 0, 0]


def test_kimi_text_config_gets_a_model_type_transformers_knows():
    full = json.loads((Path(__file__).parents[1] / "data" / "model_configs" / "kimi-k2.5" / "config.json").read_text())
    text = text_config(full)
    assert text["model_type"] == "kimi_k2" and text["num_hidden_layers"] == 61
    assert known_model_type(layer_config(text, 1))["model_type"] == "deepseek_v3"
    assert known_model_type({"model_type": "llama"})["model_type"] == "llama"


def _write(tmp_path, tensors, name="model.safetensors"):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / name), metadata={"format": "pt"})


def test_prefix_is_the_text_model_not_the_vision_tower(tmp_path):
    t = {f"vision_tower.encoder.layers.{i}.w": torch.ones(2) for i in range(8)}
    t.update({f"language_model.model.layers.{i}.w": torch.ones(2) for i in range(4)})
    t["language_model.model.embed_tokens.weight"] = torch.ones(5, 2)
    _write(tmp_path, t)
    ck = Checkpoint(tmp_path)
    assert ck.text_prefix(4) == "language_model.model."
    assert ck.layer_names("language_model.model.", 2) == ["language_model.model.layers.2.w"]
    with pytest.raises(CannotStream, match="no weight prefix holds decoder layers 0..8"):
        ck.text_prefix(9)


def test_renamed_copy_keeps_bytes_and_dtypes_and_rows_are_read_by_offset(tmp_path):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 8, generator=g).to(torch.bfloat16)
    t = {"model.embed_tokens.weight": emb, "model.layers.3.a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
         "model.layers.3.b.bias": torch.randn(7, generator=g), "model.layers.3.c.scale": torch.tensor(2.0),
         "model.layers.3.d.q": torch.randint(-8, 8, (4, 4), dtype=torch.int8, generator=g)}
    _write(tmp_path, {k: v for k, v in t.items() if "embed" in k or ".a." in k}, "model-00001-of-00002.safetensors")
    _write(tmp_path, {k: v for k, v in t.items() if not ("embed" in k or ".a." in k)}, "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: "model-00001-of-00002.safetensors" if ("embed" in k or ".a." in k) else "model-00002-of-00002.safetensors"
        for k in t}}))
    ck = Checkpoint(tmp_path)
    names = ck.layer_names("model.", 3)
    out = tmp_path / "one" / "model.safetensors"
    out.parent.mkdir()
    ck.write_renamed({x: "model.layers.0." + x[len("model.layers.3."):] for x in names}, out)
    back = load_file(str(out))
    assert sorted(back) == ["model.layers.0.a.weight", "model.layers.0.b.bias", "model.layers.0.c.scale",
                            "model.layers.0.d.q"]
    for x in names:
        y = "model.layers.0." + x[len("model.layers.3."):]
        assert back[y].dtype == t[x].dtype and torch.equal(back[y], t[x]), x
    ids = [7, 0, 49, 7]
    assert torch.equal(ck.rows("model.embed_tokens.weight", ids), emb[ids])
    with pytest.raises(ValueError, match="outside the embedding's 50 rows"):
        ck.rows("model.embed_tokens.weight", [50])


def test_no_safetensors_cannot_stream(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CannotStream, match="no model.safetensors"):
        Checkpoint(tmp_path)


def _diff(lid, rel, mean_cos=1.0, frac_below=0.0, worst=None):
    return LayerDiff(layer_id=lid, rel_err=rel, min_cosine=worst if worst is not None else mean_cos,
                     mean_cosine=mean_cos, frac_below=frac_below, first_below=None if not frac_below else 3)


CFG = VerifyConfig()
MAX_REL_ERR, MIN_MEAN_COSINE = CFG.reference_max_rel_err, CFG.reference_min_mean_cosine
MAX_FRAC_BELOW, COS_BOUND = CFG.reference_max_frac_below, CFG.reference_cos_bound


def test_row_problems_is_the_one_decision():
    """Per-layer statistics decide, not the single worst token: a MoE routing flip on one token of a
    clean record passes; a wrong layer, or many tokens off, fails."""
    ok = [_diff(2, MAX_REL_ERR / 2, MIN_MEAN_COSINE + 0.001), _diff(8, 0.0),
          _diff(4, 0.03, 0.998, frac_below=MAX_FRAC_BELOW / 2, worst=0.2)]  # one token flipped, the rest right
    assert _row_problems(ok, CFG) == []
    bad = _row_problems([_diff(2, MAX_REL_ERR * 2), _diff(4, 0.0, MIN_MEAN_COSINE - 0.01), _diff(8, 0.0),
                         _diff(5, 0.05, 0.995, frac_below=MAX_FRAC_BELOW * 2)], CFG)
    assert [b.split(" differs")[0] for b in bad] == ["layer 2", "layer 4", "layer 5"]
    assert all("from the reference" in b and f"cosine {COS_BOUND}" in b for b in bad)


def _turned(ref, cosines: dict[int, float]):
    """`ref` [T, 1, H] with unit rows, and a copy whose token t is turned to cosine `cosines[t]` (same norm)."""
    got = ref.clone()
    for t, c in cosines.items():
        r = ref[t, 0]
        u = torch.randn_like(r)
        u = u - (u @ r) * r
        got[t, 0] = c * r + (1 - c * c) ** 0.5 * u / u.norm()
    return got


def test_reference_thresholds_are_the_configs():
    """The defaults are the calibrated values, and each threshold, tightened in the config, fails a record
    that passes at the default (the same two calls as reference_check, the message naming the configured limit)."""
    from eagle3_pipeline.records.contracts import compare_layers

    assert (MAX_REL_ERR, MIN_MEAN_COSINE, COS_BOUND, MAX_FRAC_BELOW) == (0.15, 0.99, 0.95, 0.10)
    torch.manual_seed(0)
    ref = torch.nn.functional.normalize(torch.randn(50, 1, 16), dim=-1)
    # 2 of 50 tokens at cosine 0.90 (a MoE routing flip), 5 at 0.96: relative error 0.126, mean cosine 0.992
    got = _turned(ref, {3: 0.90, 9: 0.90, **{t: 0.96 for t in range(20, 25)}})

    def problems(cfg):
        return _row_problems(compare_layers(got, ref, [4], cfg.reference_cos_bound), cfg)

    assert problems(CFG) == []
    for key, value, says in [("reference_max_rel_err", 0.1, "relative error 0.126"),
                             ("reference_min_mean_cosine", 0.995, "(min 0.995)"),
                             ("reference_cos_bound", 0.97, "14.0% of tokens below cosine 0.97"),
                             ("reference_max_frac_below", 0.03, "(max 3%")]:
        tight = CFG.model_copy(update={key: value})
        got_problems = problems(tight)
        assert len(got_problems) == 1 and "layer 4 differs" in got_problems[0] and says in got_problems[0], key
        assert _config_key(tight) != _config_key(CFG)  # a changed threshold is verified again, not read from cache


@pytest.mark.parametrize("key, value", [("reference_max_rel_err", 0), ("reference_min_mean_cosine", 1.5),
                                        ("reference_cos_bound", 0), ("reference_max_frac_below", -0.1)])
def test_reference_thresholds_out_of_range_are_config_errors(key, value):
    with pytest.raises(ValueError, match=key):
        VerifyConfig(**{key: value})
