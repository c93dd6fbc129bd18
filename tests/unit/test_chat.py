"""Loss masks proven token by token on three templates of different style, multi-turn."""

import pytest

from eagle3_pipeline.data.chat import encode_conversation

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# re-renders history: only the last assistant turn keeps its content (like templates that strip reasoning)
REWRITES_HISTORY = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                    "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {
    "tiny": (None, [], "<|end|>\n"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>\n"),
}
CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5. The answer is 5."},
    {"role": "user", "content": "Reverse the word cat."},
    {"role": "assistant", "content": "The word cat reversed is tac."},
]


def _tok(tiny_target, template, specials):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    if template:
        tok.chat_template = template
        tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _masked_runs(ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("name", TEMPLATES)
def test_mask_covers_exactly_assistant_tokens_and_end_of_turn(tiny_target, name):
    template, specials, eot = TEMPLATES[name]
    tok = _tok(tiny_target, template, specials)
    [row] = encode_conversation(tok, CONV)
    assert len(row.input_ids) == len(row.loss_mask)
    runs = _masked_runs(row.input_ids, row.loss_mask)
    assert len(runs) == 2, "one contiguous masked run per assistant turn"
    want = [m["content"] + eot for m in CONV if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs] == want
    # token by token: the full rendering re-encodes to the same ids (no boundary artefacts)
    full = tok.apply_chat_template(CONV, tokenize=False)
    assert tok(full, add_special_tokens=False)["input_ids"] == row.input_ids


@pytest.mark.parametrize("name", TEMPLATES)
def test_one_row_per_turn(tiny_target, name):
    template, specials, eot = TEMPLATES[name]
    tok = _tok(tiny_target, template, specials)
    rows = encode_conversation(tok, CONV, rows_per="turn")
    assert [r.turn_index for r in rows] == [0, 1]
    for r, content in zip(rows, [m["content"] for m in CONV if m["role"] == "assistant"]):
        [run] = _masked_runs(r.input_ids, r.loss_mask)
        assert tok.decode(run) == content + eot
        assert r.loss_mask[-len(run):] == [1] * len(run)  # the row ends with its supervised turn


def test_template_that_rewrites_history_gives_a_row_per_rendering(tiny_target):
    """Only the last assistant turn keeps its content: turn 0 is supervised in the rendering that ends
    with it, turn 1 in the full rendering (where turn 0 shows as '...', unsupervised)."""
    tok = _tok(tiny_target, REWRITES_HISTORY, ["<|im_start|>", "<|im_end|>"])
    rows = encode_conversation(tok, CONV)
    assert [r.turn_index for r in rows] == [0, 1]
    contents = [m["content"] for m in CONV if m["role"] == "assistant"]
    for r, content in zip(rows, contents):
        [run] = _masked_runs(r.input_ids, r.loss_mask)
        assert tok.decode(run) == content + "<|im_end|>\n" and r.loss_mask[-1] == 1
    assert tok.decode(rows[1].input_ids) == tok.apply_chat_template(CONV, tokenize=False)
    assert contents[0] not in tok.decode(rows[1].input_ids)
    assert [(r.input_ids, r.loss_mask) for r in encode_conversation(tok, CONV, rows_per="turn")] == \
        [(r.input_ids, r.loss_mask) for r in rows]
