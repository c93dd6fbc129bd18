"""Random small targets of other architectures, built locally for gate calibration tests: the tiny
target's tokenizer (fast, chat template) on a random Qwen3 (qk-norm, GQA) or a random DeepSeek-V3
(MLA with the 512 + 64 head vLLM's CPU kernel takes, routed + shared experts, noaux_tc routing, first
layer dense). Weights are random (seeded), saved in bf16 with `save_pretrained`; nothing is trained."""

from __future__ import annotations

from pathlib import Path


def _save(model, tok, out: Path) -> Path:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def random_qwen3(tokenizer_dir: Path, out: Path, num_layers: int = 6, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    return _save(Qwen3ForCausalLM(cfg), tok, out)


def random_deepseek_v3(tokenizer_dir: Path, out: Path, num_layers: int = 5, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        norm_topk_prob=True, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=2048, num_nextn_predict_layers=0,
        topk_method="noaux_tc", scoring_func="sigmoid", bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a non-zero routing bias, as trained DeepSeek-V3 checkpoints have
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.uniform_(-0.05, 0.05)
    return _save(model, tok, out)
