"""The embedded tiny target: a BPE tokenizer with a chat template and a small Llama trained on the
procedural corpus until its greedy answers are mostly right.

Owns: `build_tiny_target(cfg, out_dir)` which writes a normal Hugging Face model directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with `chat_template`,
generation_config.json) plus `tiny_target.json` (what was built, the training curve and the greedy
accuracy on held-out conversations) and `corpus/` (the ShareGPT + OpenAI JSONL files). Reads nothing.
Deterministic for a given config (seeds for corpus and weights).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.data.chat import encode_conversation
from eagle3_pipeline.core.store import atomic_write_text
from eagle3_pipeline.tiny import corpus
from eagle3_pipeline.tiny.training import train_lm

BOS, EOT, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
# Role marker, newline, content, end-of-turn marker, newline. The generation prompt opens an
# assistant turn; the model closes it with <|end|> (its eos).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class TinyTargetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    corpus_rows: int = 6000
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 4  # head_dim = 32: vLLM's CPU attention does not support 16
    num_kv_heads: int = 2
    intermediate_size: int = 384
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    max_steps: int = 320  # the budget: ~2.5 min on 2 idle cores; deterministic, unlike a time budget
    eval_conversations: int = 40


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOT, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token=PAD,
                                   additional_special_tokens=ROLE_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _messages(c: dict) -> list[dict]:
    return corpus.to_openai(c)["messages"]


def _greedy_accuracy(model, tok, convs: list[dict]) -> float:
    """Fraction of held-out first turns whose greedy answer equals the computed answer exactly."""
    import torch

    right = 0
    model.eval()
    with torch.no_grad():
        for c in convs:
            msgs = _messages(c)
            first_assistant = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            prompt = tok.apply_chat_template(msgs[:first_assistant], add_generation_prompt=True,
                                             tokenize=False)
            ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            right += text == msgs[first_assistant]["content"]
    return right / max(1, len(convs))


def build_tiny_target(cfg: TinyTargetConfig, out_dir: Path, log=print) -> dict:
    """Build corpus, tokenizer and trained model into `out_dir`; return the summary record."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    paths = corpus.write_corpus(out_dir / "corpus", cfg.corpus_rows, cfg.seed)
    convs = list(corpus.generate(cfg.corpus_rows, cfg.seed))
    held_out = list(corpus.generate(cfg.eval_conversations, cfg.seed + 10_000))
    tok = _train_tokenizer([m["content"] for c in convs for m in _messages(c)], cfg.vocab_size)
    # Pack whole conversations into fixed-length rows; the loss covers assistant tokens only (the
    # prompts hold random numbers that cannot be predicted, and would only dilute the gradient).
    stream: list[int] = []
    labels: list[int] = []
    for c in convs:
        enc = encode_conversation(tok, _messages(c))[0]
        stream += enc.input_ids
        labels += [t if m else -100 for t, m in zip(enc.input_ids, enc.loss_mask)]
    n = len(stream) // cfg.seq_len * cfg.seq_len
    data = torch.tensor(stream[:n]).view(-1, cfg.seq_len)
    targets = torch.tensor(labels[:n]).view(-1, cfg.seq_len)
    log(f"tiny target: {len(convs)} conversations, {len(stream)} tokens, vocab {len(tok)}")

    mcfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(mcfg)
    curve, step, t_train = train_lm(model, data, targets, cfg, log, "tiny target")
    acc = _greedy_accuracy(model, tok, held_out)
    log(f"tiny target: {step} steps in {time.time() - t_train:.0f}s, greedy accuracy {acc:.2f}")

    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    summary = {
        "config": cfg.model_dump(), "params": sum(p.numel() for p in model.parameters()),
        "corpus": {k: str(v) for k, v in paths.items()}, "corpus_tokens": len(stream),
        "steps": step, "final_loss": curve[-1]["loss"] if curve else None, "loss_curve": curve,
        "greedy_accuracy": acc, "build_seconds": round(time.time() - t0, 1),
    }
    atomic_write_text(out_dir / "tiny_target.json", json.dumps(summary, indent=2))
    return summary
