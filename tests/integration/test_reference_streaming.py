"""The verify reference streams the target one decoder layer at a time (verify/worker.py, a child
process) and must equal a full-model Hugging Face forward in the same dtype (bf16), on three
architectures: the tiny Llama (one model.safetensors), a random tiny Qwen3 (6 layers, 2 shards + index)
and a random tiny DeepSeek-V3 MoE (MLA 512 + 64, 4 routed + 1 shared experts, first layer dense,
noaux_tc) wrapped the way Kimi-K2.5 nests its text model (`language_model.` prefix, `text_config`,
a vision tower with its own `layers.{i}`), over 2 shards + index. Also: the peak RSS is reported, a
budget too small fails naming budget, layer and RSS, and the gate's `reference_check` passes a
clean extraction with per-layer statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.core.config import TargetConfig, VerifyConfig
from eagle3_pipeline.verify.reference import ReferenceBudgetExceeded, reference_check, stream_reference

TOL = 1e-2  # bf16; measured: bit-identical on all three targets


def _full_forward(model_dir: Path, samples: dict[int, list[int]], layer_ids: list[int]) -> dict[int, torch.Tensor]:
    """The full model in bf16: HF hidden_states[k] for k < N, the last layer's pre-norm output for N."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    n = len(model.model.layers)
    last = {}
    model.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    refs = {}
    for row, ids in samples.items():
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        refs[row] = torch.stack([last["h"][0] if k == n else out.hidden_states[k][0] for k in layer_ids], dim=1)
    return refs  # row -> [T, L, H]


def _samples(vocab: int) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(0)
    return {0: torch.randint(0, vocab, (9,), generator=g).tolist(), 5: torch.randint(0, vocab, (33,), generator=g).tolist()}


def _assert_same(streamed: dict, full: dict, layer_ids: list[int]) -> dict[int, float]:
    worst = {}
    for row, ref in full.items():
        got = streamed[row]
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
        for li, lid in enumerate(layer_ids):
            g, r = got[:, li].float(), ref[:, li].float()
            worst[lid] = max(worst.get(lid, 0.0), float((g - r).norm() / r.norm()))
    assert max(worst.values()) < TOL, worst
    return worst


def _split_checkpoint(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """Two safetensors shards and model.safetensors.index.json, split half-way through the names."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in halves.items():
        save_file({k: tensors[k].contiguous() for k in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("tiny-qwen3")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out, max_shard_size="300KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) == 2
    return out


@pytest.fixture(scope="module")
def tiny_moe_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(plain DeepseekV3ForCausalLM dir, the same weights wrapped like Kimi-K2.5 over 2 shards)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64,
        qk_nope_head_dim=16, v_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid",
        num_nextn_predict_layers=0, tie_word_embeddings=False, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # routing must not be a tie: a non-zero correction bias
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
    plain = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(plain)  # per-expert tensors, as real DeepSeek-V3 / Kimi checkpoints store them
    tensors = load_file(str(plain / "model.safetensors"))
    assert any(".mlp.experts.3.gate_proj.weight" in k for k in tensors)
    wrapped = tmp_path_factory.mktemp("tiny-kimi")
    text = {**json.loads((plain / "config.json").read_text()), "model_type": "kimi_k2"}  # unknown to transformers
    (wrapped / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": {"num_hidden_layers": 6}}))
    nested = {"language_model." + k: v for k, v in tensors.items()}
    nested.update({f"vision_tower.encoder.layers.{i}.mlp.fc1.weight": torch.ones(4, 4) for i in range(6)})
    nested["mm_projector.proj.weight"] = torch.ones(4, 4)
    _split_checkpoint(nested, wrapped)
    return plain, wrapped


def _stream(model_dir: Path, samples, layer_ids, work: Path, memory_gb: float = 8.0):
    lines = []
    out, refs = stream_reference(TargetConfig(model=str(model_dir)), samples, layer_ids, work,
                                 memory_gb=memory_gb, timeout_s=300, log=lines.append)
    return out, refs, lines


def test_streamed_equals_full_model_tiny_llama(tiny_target, tmp_path):
    ids = [0, 2, 4, 5, 8]  # 8 = N: the last layer before the final norm
    samples = _samples(json.loads((tiny_target / "config.json").read_text())["vocab_size"])
    out, refs, lines = _stream(tiny_target, samples, ids, tmp_path / "work")
    assert out.skipped is None and out.layers_run == 8 and sorted(refs) == sorted(samples)
    worst = _assert_same(refs, _full_forward(tiny_target, samples, ids), ids)
    assert out.peak_rss_bytes and out.peak_rss_bytes >= out.baseline_rss_bytes > 0
    assert any("layer 7" in line and "peak RSS" in line for line in lines), lines[-5:]
    assert not (tmp_path / "work").exists()  # the one-layer checkpoints are gone
    print(f"tiny llama: max rel err {max(worst.values()):.2e}, peak RSS {out.peak_rss_bytes / 2**20:.0f} MiB")


def test_streamed_equals_full_model_qwen3_two_shards(tiny_qwen3, tmp_path):
    ids = [1, 3, 4, 6]  # deepest id N=6; layer 0 (embeddings) not asked
    samples = _samples(256)
    out, refs, _ = _stream(tiny_qwen3, samples, ids, tmp_path / "work")
    assert out.skipped is None and out.layers_run == 6
    _assert_same(refs, _full_forward(tiny_qwen3, samples, ids), ids)


def test_streamed_equals_full_model_kimi_like_moe(tiny_moe_pair, tmp_path):
    """Only up to the deepest id asked (3 of 4 layers), through the wrapper prefix, dense layer 0 and
    MoE layers 1-2 each built as layer 0 of a one-layer model."""
    plain, wrapped = tiny_moe_pair
    ids = [0, 1, 2, 3]
    samples = _samples(256)
    out, refs, lines = _stream(wrapped, samples, ids, tmp_path / "work")
    assert out.skipped is None and out.layers_run == 3, out
    assert any("prefix 'language_model.model.'" in line for line in lines), lines[:3]
    _assert_same(refs, _full_forward(plain, samples, ids), ids)


def test_memory_budget_too_small_fails_naming_budget_layer_and_rss(tiny_qwen3, tmp_path):
    with pytest.raises(ReferenceBudgetExceeded) as e:
        _stream(tiny_qwen3, _samples(256), [1, 6], tmp_path / "work", memory_gb=0.05)
    msg = str(e.value)
    assert "verify.reference_memory_gb" in msg and "layer 0" in msg and "RSS" in msg and "0.05 GiB" in msg, msg


def test_gate_reference_check_streams_and_reports(extracted, tiny_config, tmp_path):
    """The gate's entry point on a copy of a vLLM extraction where row 3's first aux layer holds the
    next layer's states: row 0 passes, row 3 is named with that layer; per-layer stats, peak RSS."""
    import shutil

    from eagle3_pipeline.records.contracts import read_record, write_record

    version = extracted.version.model_copy(update={"dir": str(tmp_path / "copy")})
    shutil.copytree(extracted.hidden_states, version.hidden_states_dir)
    rec = read_record(version.record_path(3))
    rec["hidden_states"][:, 0] = rec["hidden_states"][:, 1]  # [T, L, H]: id 2 <- id 4
    version.record_path(3).unlink()
    write_record(version.record_path(3), rec, version.layer_ids, version.storage_dtype)
    lines = []
    res = reference_check(tiny_config.target, version, [0, 3], log=lines.append, cfg=VerifyConfig(reference_memory_gb=4))
    lid = version.layer_ids[0]
    assert res.bad_rows == [3] and res.skipped is None, res.problems
    assert len(res.problems) == 2 and all(p.startswith("hs_3 (sample ") for p in res.problems), res.problems
    assert f"layer {lid} differs from the reference" in res.problems[0]
    # and it is nearer the layer beside it than its own (the neighbour check: the layer map is off)
    assert f"layer slot 0 (layer {lid}) is nearer the reference's layer {lid + 1} " in res.problems[1], res.problems
    assert sorted(res.per_layer) == sorted(version.layer_ids)
    for k, st in res.per_layer.items():
        assert 0.0 <= st["max_frac_below"] <= 1.0 and st["mean_cosine"] >= st["min_cosine"], (k, st)
        if k != lid:  # row 0 and the other layers of row 3: vLLM bf16 vs the streamed HF bf16 reference
            assert st["max_rel_err"] < 0.10 and st["min_cosine"] > 0.99, (k, st)
    assert res.per_layer[lid]["max_rel_err"] > 0.10
    assert res.peak_rss_bytes and res.peak_rss_bytes < 4 * 2**30
    assert (version.path / "logs" / "verify-reference.log").is_file()
    assert not list((version.path / ".scratch").glob("verify-reference*"))
    print(f"tiny llama vs vLLM: {res.per_layer}, peak RSS {res.peak_rss_bytes / 2**20:.0f} MiB")
