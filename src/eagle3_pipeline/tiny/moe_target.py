"""The embedded `tiny-moe` target: Kimi-K2.5's shape at a few million parameters.

Owns `build_tiny_moe(cfg, out_dir)`, which writes a Hugging Face model directory of the DeepSeek-V3
family (`DeepseekV3ForCausalLM`: MLA attention with kv_lora_rank + qk_rope_head_dim = 512 + 64, the
head size vLLM's CPU MLA kernel takes; routed + shared experts with sigmoid scores, `noaux_tc` top-k
and its `e_score_correction_bias`; the first layer dense), trained on the agentic corpus
(`tiny/agentic.py`) until its greedy turns are mostly right, plus
  - a Python-backend tokenizer loaded through `trust_remote_code`: `tokenization_tiny_moe.py` (copied
    from this package), `tiktoken.model` (BPE ranks learned on the corpus), `tokenizer_config.json`
    with `auto_map`, no tokenizer.json;
  - `chat_template.jinja`: tools, assistant tool calls, tool results, and `<think>` blocks whose
    reasoning is shown only for assistant turns after the last user turn;
  - `tiny_target.json` (what was built, loss curve, greedy accuracy, build seconds) and `corpus/`.
Reads nothing. Deterministic for a given config (seeds for corpus, tokenizer and weights).
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core.store import atomic_write_text
from eagle3_pipeline.tiny import agentic
from eagle3_pipeline.tiny.training import train_lm
from eagle3_pipeline.tiny import tokenization_tiny_moe as tokmod

TOKENIZER_MODULE = "tokenization_tiny_moe"
TOKENIZER_CLASS = "TinyMoeTokenizer"

# Every turn opens with a role token and closes with <|turn_end|>; no text sits between turns, so a
# turn's tokens do not depend on its neighbours. Assistant turns always carry a <think> block; its
# reasoning is rendered only after the last user turn (earlier reasoning is dropped from history).
CHAT_TEMPLATE = """\
{%- macro text(c) -%}
{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}{{ p['text'] }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- bos_token -}}
{%- if tools -%}<|tools|>{{ tools | tojson }}<|turn_end|>{%- endif -%}
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
<|assistant|><think>
{%- if loop.index0 > ns.last_user and m['reasoning_content'] is defined and m['reasoning_content'] -%}
{{ m['reasoning_content'] }}
{%- endif -%}
</think>{{ text(m['content']) }}
{%- if m['tool_calls'] is defined and m['tool_calls'] -%}
<|calls|>
{%- for call in m['tool_calls'] -%}
{%- set f = call['function'] if call['function'] is defined else call -%}
<|call|>{{ call['id'] if call['id'] is defined else loop.index0 }} {{ f['name'] }}<|args|>
{%- if f['arguments'] is string -%}{{ f['arguments'] }}{%- else -%}{{ f['arguments'] | tojson }}{%- endif -%}
<|call_end|>
{%- endfor -%}
<|calls_end|>
{%- endif -%}
<|turn_end|>
{%- elif m['role'] == 'tool' -%}
<|tool|>{{ m['tool_call_id'] if m['tool_call_id'] is defined else '' }}<|body|>{{ text(m['content']) }}<|turn_end|>
{%- elif m['role'] in ('system', 'developer') -%}
<|system|>{{ text(m['content']) }}<|turn_end|>
{%- else -%}
<|user|>{{ text(m['content']) }}<|turn_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}
"""


class TinyMoeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    corpus_rows: int = 4000
    tool_fraction: float = 0.4
    vocab_size: int = 1024             # BPE ranks + special tokens
    hidden_size: int = 128
    num_layers: int = 7
    first_k_dense_replace: int = 1     # layer 0 dense, the rest MoE (as in Kimi-K2.5: 1 of 61)
    num_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 512            # + qk_rope_head_dim = 576: the only MLA head size vLLM's CPU kernel takes
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate_size: int = 384       # the dense layer's MLP
    moe_intermediate_size: int = 128   # per expert
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    bias_update_rate: float = 1e-3     # aux-loss-free balancing of e_score_correction_bias
    seq_len: int = 512                 # rows of whole sequences (pack_segments): the longest is ~535 tokens
    batch_size: int = 4                # 4 x 512 tokens: ~0.55 s a step on 2 idle cores
    lr: float = 3e-3
    max_steps: int = 640               # the budget; deterministic, unlike a time budget
    # (measured, same corpus: 320 steps of 8 x 256-token stream rows: loss 0.70, greedy accuracy 0.00;
    # 640 such steps: 0.59, 0.00; 640 steps of 4 x 512 whole-sequence rows: 0.49, 0.02; lr 8e-3 was worse)
    eval_conversations: int = 40


# ------------------------------------------------------------------ tokenizer

def _bpe_texts(rows: list[dict]) -> list[str]:
    """The text between special tokens that the template renders: what the BPE should learn."""
    out = []
    for row in rows:
        if row.get("tools"):
            out.append(json.dumps(row["tools"]))
        for m in row["messages"]:
            out += [m.get("content") or "", m.get("reasoning_content") or ""]
            for call in m.get("tool_calls") or []:
                out += [f"{call['id']} {call['function']['name']}", call["function"]["arguments"]]
            if m["role"] == "tool":
                out.append(m["tool_call_id"])
    return [t for t in out if t]


def _train_ranks(texts: list[str], n_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE learned with the `tokenizers` library, exported as tiktoken ranks."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokmod.PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=n_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    char_to_byte = {c: b for b, c in tokmod.byte_to_char().items()}
    by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return {bytes(char_to_byte[c] for c in s): rank for rank, (s, _) in enumerate(by_id)}


def write_tokenizer(out_dir: Path, ranks: dict[bytes, int]) -> None:
    """The tokenizer files of the model directory (loaded back with trust_remote_code)."""
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    atomic_write_text(out_dir / "tiktoken.model", "\n".join(lines) + "\n")
    shutil.copyfile(tokmod.__file__, out_dir / f"{TOKENIZER_MODULE}.py")
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "auto_map": {"AutoTokenizer": [f"{TOKENIZER_MODULE}.{TOKENIZER_CLASS}", None]},
        "bos_token": tokmod.BOS, "eos_token": tokmod.EOT, "pad_token": tokmod.PAD,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }
    atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(config, indent=2))
    atomic_write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)


def asks_for_remote_code(model_dir: Path) -> bool:
    """Whether the model directory's own tokenizer config asks for its shipped code (an `auto_map`),
    as the one this builder writes does; nothing else decides it."""
    cfg = Path(model_dir) / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("auto_map"))


def load_tokenizer(model_dir: Path):
    """The built tokenizer, loaded as every consumer loads it: through the code its config names."""
    from transformers import AutoTokenizer

    trust_remote_code = asks_for_remote_code(model_dir)
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


# ------------------------------------------------------------------ training rows

TURN_START = re.compile(r"(?=<\|(?:system|user|assistant|tool)\|>)")  # not <|tools|>


def split_turns(text: str) -> list[str]:
    """A rendering of CHAT_TEMPLATE cut before every turn's role token: [preamble, turn 0, turn 1, ...]
    (one turn per message; the preamble is the bos token and the tools block)."""
    return TURN_START.split(text)


def encode_segments(tok, row: dict) -> list[tuple[list[int], list[int]]]:
    """One training sequence per user turn: the conversation up to the last answer to that turn,
    rendered as the template shows it then (earlier reasoning dropped), with the loss on the
    assistant tokens after that user turn only (after each turn's role token, through <|turn_end|>).
    Turns are cut at special tokens, so tokenizing them one by one gives the ids of the whole text."""
    msgs, tools = row["messages"], row.get("tools")
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    out = []
    for k, u in enumerate(users):
        end = users[k + 1] if k + 1 < len(users) else len(msgs)
        text = tok.apply_chat_template(msgs[:end], tools=tools, tokenize=False)
        parts = split_turns(text)
        if len(parts) != end + 1:
            raise ValueError(f"{row.get('id')}: {len(parts) - 1} rendered turns for {end} messages")
        ids, mask = [], []
        for j, part in enumerate(parts, start=-1):
            head = part
            if j > u and msgs[j]["role"] == "assistant":
                head = part[:len("<|assistant|>")]
            t = tok(head, add_special_tokens=False)["input_ids"] if head else []
            ids += t
            mask += [0] * len(t)
            if head is not part:
                t = tok(part[len(head):], add_special_tokens=False)["input_ids"]
                ids += t
                mask += [1] * len(t)
        out.append((ids, mask))
    return out


def pack_segments(segments: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int):
    """(data, targets) [rows, seq_len]: each (ids, mask) sequence whole in one row (first fit, in order;
    a sequence longer than a row keeps its first seq_len tokens), the rest of a row padding with no
    loss. A question is never in one row and its answer in the next: cut into a plain token stream of
    256-token rows, ~60% of these sequences (mean 154 tokens, tools blocks) straddled a row boundary,
    and the model trained on it answered without ever looking at the question (greedy accuracy 0.00)."""
    import torch

    rows: list[tuple[list[int], list[int]]] = []
    room: list[int] = []
    for ids, mask in segments:
        ids, labels = ids[:seq_len], [t if m else -100 for t, m in zip(ids[:seq_len], mask)]
        k = next((i for i, r in enumerate(room) if r >= len(ids)), None)
        if k is None:
            rows.append(([], []))
            room.append(seq_len)
            k = len(rows) - 1
        rows[k][0].extend(ids)
        rows[k][1].extend(labels)
        room[k] -= len(ids)
    data = torch.tensor([r[0] + [pad_id] * (seq_len - len(r[0])) for r in rows])
    targets = torch.tensor([r[1] + [-100] * (seq_len - len(r[1])) for r in rows])
    return data, targets


# ------------------------------------------------------------------ model

def model_config(cfg: TinyMoeConfig, tok):
    """DeepSeek-V3 config; `topk_method`/`scoring_func` are not transformers fields but vLLM's
    loader needs them (without noaux_tc it has no parameter for e_score_correction_bias)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=1, topk_group=1, norm_topk_prob=True, first_k_dense_replace=cfg.first_k_dense_replace,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, max_position_embeddings=4096,
        num_nextn_predict_layers=0, topk_method="noaux_tc", scoring_func="sigmoid",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False)


class _BiasBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): after each step every router's
    e_score_correction_bias moves by `rate` towards its under-loaded experts. Counts come from
    forward hooks on the routers (their third output is the chosen experts [tokens, k])."""

    def __init__(self, model, rate: float):
        import torch

        self.rate, self.routers, self.counts = rate, [], []
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                i = len(self.routers)
                self.routers.append(mod)
                self.counts.append(torch.zeros(mod.num_experts))
                mod.register_forward_hook(lambda m, a, out, i=i: self._count(i, out[2]))

    def _count(self, i: int, topk_indices) -> None:
        import torch

        if self.routers[i].training:
            self.counts[i] += torch.bincount(topk_indices.flatten(), minlength=len(self.counts[i])).float()

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for router, c in zip(self.routers, self.counts):
                router.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
                c.zero_()

    def max_abs_bias(self) -> float:
        return max(float(r.e_score_correction_bias.abs().max()) for r in self.routers)


def _eval_turns(tok, row: dict) -> list[tuple[str, list[int], list[int]]]:
    """The assistant turns answering the first user turn: (kind, prompt ids, reference ids). The
    reference is the turn after its role token, through <|turn_end|>; the prompt is what precedes it."""
    msgs, tools = row["messages"], row.get("tools")
    u = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    turns = []
    for j in range(u + 1, len(msgs)):
        m = msgs[j]
        if m["role"] == "user":
            break
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(msgs[:j], tools=tools, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs[:j + 1], tools=tools, tokenize=False)
        ref = split_turns(full)[j + 1][len("<|assistant|>"):]
        kind = "call" if m.get("tool_calls") else "final" if msgs[j - 1]["role"] == "tool" else "answer"
        turns.append((kind, tok(prompt, add_special_tokens=False)["input_ids"],
                       tok(ref, add_special_tokens=False)["input_ids"]))
    return turns


def greedy_accuracy(model, tok, rows: list[dict]) -> dict:
    """Fraction of held-out assistant turns (those answering each row's first user turn, given the
    true history) whose greedy generation equals the reference token for token; also per kind:
    plain `answer`, tool `call`, `final` answer after tool results."""
    import torch

    right: dict[str, list[int]] = {}
    model.eval()
    with torch.no_grad():
        for row in rows:
            for kind, prompt, ref in _eval_turns(tok, row):
                ids = torch.tensor([prompt])
                out = model.generate(ids, max_new_tokens=len(ref) + 8, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
                got = out[0, ids.shape[1]:].tolist()
                right.setdefault(kind, []).append(int(got == ref))
    every = [x for v in right.values() for x in v]
    return {"accuracy": sum(every) / max(1, len(every)), "turns": len(every),
            "per_kind": {k: round(sum(v) / len(v), 3) for k, v in sorted(right.items())}}


def build_tiny_moe(cfg: TinyMoeConfig, out_dir: Path, log=print) -> dict:
    """Build corpus, tokenizer and trained model into `out_dir`; return the summary record."""
    import torch
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    paths = agentic.write_corpus(out_dir / "corpus", cfg.corpus_rows, cfg.seed, cfg.tool_fraction)
    rows = list(agentic.generate(cfg.corpus_rows, cfg.seed, cfg.tool_fraction))
    held_out = list(agentic.generate(cfg.eval_conversations, cfg.seed + 10_000, cfg.tool_fraction))
    ranks = _train_ranks(_bpe_texts(rows), cfg.vocab_size - len(tokmod.SPECIAL_TOKENS))
    write_tokenizer(out_dir, ranks)
    tok = load_tokenizer(out_dir)  # through trust_remote_code, as every consumer will load it
    # Whole per-user-turn sequences packed into fixed-length rows; loss on assistant tokens only.
    segments = [seg for row in rows for seg in encode_segments(tok, row)]
    data, targets = pack_segments(segments, cfg.seq_len, tok.pad_token_id)
    log(f"tiny-moe: {len(rows)} conversations in {data.shape[0]} rows of {cfg.seq_len}, "
        f"{int((targets != -100).sum())} supervised tokens, vocab {len(tok)}, {time.time() - t0:.0f}s")

    model = DeepseekV3ForCausalLM(model_config(cfg, tok))
    balancer = _BiasBalancer(model, cfg.bias_update_rate)
    curve, step, t_train = train_lm(model, data, targets, cfg, log, "tiny-moe", after_step=balancer.step)
    train_s = time.time() - t_train
    acc = greedy_accuracy(model, tok, held_out)
    log(f"tiny-moe: {step} steps in {train_s:.0f}s, greedy accuracy {acc['accuracy']:.2f} "
        f"over {acc['turns']} turns {acc['per_kind']}")

    model = model.to(torch.bfloat16)
    for r in balancer.routers:  # fp32 like DeepSeek-V3's checkpoints (vLLM loads it into its dtype)
        r.e_score_correction_bias.data = r.e_score_correction_bias.data.float()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out_dir)
    summary = {
        "kind": "moe", "config": cfg.model_dump(), "params": sum(p.numel() for p in model.parameters()),
        "architecture": "DeepseekV3ForCausalLM", "corpus": {k: str(v) for k, v in paths.items()},
        "corpus_tokens": sum(len(ids) for ids, _ in segments), "steps": step, "train_seconds": round(train_s, 1),
        "final_loss": curve[-1]["loss"] if curve else None, "loss_curve": curve,
        "max_abs_e_score_correction_bias": round(balancer.max_abs_bias(), 4),
        "greedy_accuracy": acc["accuracy"], "greedy_accuracy_per_kind": acc["per_kind"],
        "greedy_turns": acc["turns"], "build_seconds": round(time.time() - t0, 1),
    }
    atomic_write_text(out_dir / "tiny_target.json", json.dumps(summary, indent=2))
    return summary
