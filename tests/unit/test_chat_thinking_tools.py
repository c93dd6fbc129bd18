"""Thinking templates (history re-rendered) and tool use: each assistant turn is supervised as the
model sees it at inference; tool calls are supervised, tool results and system prompts are not;
a template that cannot render tool calls quarantines the row with that reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import PrepareConfig, SourceConfig, TargetConfig
from eagle3_pipeline.data.chat import TemplateMismatch, ToolCallsNotRendered, encode_conversation
from eagle3_pipeline.data.formats import Conversation, Rejected, normalise

# Written for these tests (Qwen3-like behaviour): tool definitions in the system turn, reasoning
# (`reasoning_content` or an inline <think> block) shown only on assistant turns after the last user
# message, tool calls as <tool_call>{json}</tool_call>, tool results as <tool_response> in a user turn.
THINKING = r"""{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools or has_system -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system -%}{{- messages[0].content -}}{%- endif -%}
{%- if tools -%}
{{- ('\n\n' if has_system else '') + 'You can call these functions (one JSON schema per line):' -}}
{%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}
{{- '\nReply with <tool_call>{"name": ..., "arguments": ...}</tool_call> to call one.' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role in ['user', 'system'] -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set body = m.content if m.content is string else '' -%}
{%- set thought = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if '</think>' in body -%}
{%- set thought = body.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
{%- set body = body.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.index0 > ns.last_user and (thought or loop.last) -%}
{{- '<think>\n' + thought + '\n</think>\n\n' -}}
{%- endif -%}
{{- body -}}
{%- for c in m.tool_calls or [] -%}
{%- set args = c.function.arguments if c.function.arguments is string else c.function.arguments | tojson -%}
{{- ('\n' if body or not loop.first else '') + '<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' + args + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
THINK_SPECIALS = ["<|im_start|>", "<|im_end|>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
AGENT = [
    {"role": "system", "content": "Be helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "The tool said 21."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "<think>\nPolite.\n</think>\n\nYou are welcome."},
]
TURN_CALL = ('<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n')
TURN_ANSWER = "<think>\nThe tool said 21.\n</think>\n\nIt is 21 degrees.<|im_end|>\n"
TURN_THANKS = "<think>\nPolite.\n</think>\n\nYou are welcome.<|im_end|>\n"


def _tok(tiny_target, template=THINKING, specials=THINK_SPECIALS):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    if template:
        tok.chat_template = template
        tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _runs(tok, row) -> list[str]:
    runs, cur = [], []
    for t, m in zip(row.input_ids + [None], row.loss_mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def test_thinking_template_rows_per_rendering(tiny_target):
    """Turns 0 and 1 come after the first user message: rendered with their reasoning, in one row
    that ends with turn 1; turn 2 is rendered after 'Thanks!', where the template strips the earlier
    reasoning: the full rendering, with only turn 2 supervised."""
    tok = _tok(tiny_target)
    rows = encode_conversation(tok, AGENT, tools=TOOLS)
    assert [r.turn_index for r in rows] == [1, 2]
    assert _runs(tok, rows[0]) == [TURN_CALL, TURN_ANSWER]
    assert _runs(tok, rows[1]) == [TURN_THANKS]
    full = tok.apply_chat_template(AGENT, tools=TOOLS, tokenize=False)
    assert tok(full, add_special_tokens=False)["input_ids"] == rows[1].input_ids
    assert "I should call the tool" not in full  # history as the template renders it for the last turn
    for r in rows:  # tool results, the system prompt and the tool definitions are never supervised
        text = "".join(_runs(tok, r))
        assert "tool_response" not in text and "Be helpful" not in text and "description" not in text


def test_thinking_template_one_row_per_turn(tiny_target):
    tok = _tok(tiny_target)
    rows = encode_conversation(tok, AGENT, rows_per="turn", tools=TOOLS)
    assert [r.turn_index for r in rows] == [0, 1, 2]
    assert [_runs(tok, r) for r in rows] == [[TURN_CALL], [TURN_ANSWER], [TURN_THANKS]]
    for r in rows:
        assert r.loss_mask[-1] == 1  # each row ends with its supervised turn


def test_inline_think_equals_reasoning_content(tiny_target):
    tok = _tok(tiny_target)
    a = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5.", "reasoning_content": "add"},
         {"role": "user", "content": "and 4 + 4?"}, {"role": "assistant", "content": "8.", "reasoning_content": "add again"}]
    b = [m if m["role"] != "assistant" else {"role": "assistant", "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
         for m in a]
    ra, rb = encode_conversation(tok, a), encode_conversation(tok, b)
    assert [(r.input_ids, r.loss_mask, r.turn_index) for r in ra] == [(r.input_ids, r.loss_mask, r.turn_index) for r in rb]
    assert [_runs(tok, r) for r in ra] == [["<think>\nadd\n</think>\n\n5.<|im_end|>\n"],
                                           ["<think>\nadd again\n</think>\n\n8.<|im_end|>\n"]]


def test_template_without_history_rewriting_keeps_one_row(tiny_target):
    """No reasoning anywhere and the last turn thinks empty: the earlier turns render the same in
    every prefix, so the conversation is one row (as before)."""
    tok = _tok(tiny_target)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    [row] = encode_conversation(tok, msgs)
    assert row.turn_index is None and _runs(tok, row) == ["<think>\n\n</think>\n\nhello<|im_end|>\n"]


def test_argument_forms_render_the_same(tiny_target):
    tok = _tok(tiny_target)
    as_object = [m if not m.get("tool_calls") else
                 {**m, "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
                 for m in AGENT]
    a, b = encode_conversation(tok, AGENT, tools=TOOLS), encode_conversation(tok, as_object, tools=TOOLS)
    assert [(r.input_ids, r.loss_mask) for r in a] == [(r.input_ids, r.loss_mask) for r in b]


# a template that applies tojson to the arguments (wants objects), and one that concatenates them (wants strings)
TOJSON = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
          "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONCAT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
          "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + ' ' + c.function.arguments + '</tool_call>' }}{% endfor %}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SIMPLE = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "content": "21"}, {"role": "assistant", "content": "21 degrees."}]


@pytest.mark.parametrize("template,args", [(TOJSON, '{"city": "Paris"}'), (CONCAT, {"city": "Paris"})])
def test_arguments_switch_form_when_the_template_needs_the_other(tiny_target, template, args):
    tok = _tok(tiny_target, template)
    msgs = [m if not m.get("tool_calls") else {**m, "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                                                          "arguments": args}}]}
            for m in SIMPLE]
    [row] = encode_conversation(tok, msgs)
    call_run = _runs(tok, row)[0]
    assert call_run.startswith("<tool_call>get_weather {") and '"city": "Paris"' in call_run  # not double-encoded


def test_template_without_tool_support_is_reported(tiny_target):
    tok = _tok(tiny_target, None)  # the tiny target's own template: content only
    with pytest.raises(ToolCallsNotRendered, match="TypeError"):  # content None
        encode_conversation(tok, SIMPLE)
    with_text = [{**m, "content": "Let me look."} if m.get("tool_calls") else m for m in SIMPLE]
    with pytest.raises(ToolCallsNotRendered, match="tool call 'get_weather' is not in the rendered turn"):
        encode_conversation(tok, with_text)


def test_generation_prompt_that_the_turn_does_not_extend_is_reported(tiny_target):
    """A template whose generation prompt opens a think block while rendered turns drop reasoning
    (R1-like): the turn as the model generates it is not in any rendering, the row is quarantined."""
    forced = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    tok = _tok(tiny_target, forced)
    with pytest.raises(TemplateMismatch, match="turn 1: rendering with the generation prompt is not a prefix"):
        encode_conversation(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])


# ------------------------------------------------------------------------------------ formats

def test_openai_tool_rows_are_normalised():
    rec = {"id": "t1", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "21", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "The tool said 21."}]}
    c = normalise(rec, "openai", "x.jsonl", 0)
    assert isinstance(c, Conversation), c
    assert c.tools == TOOLS
    assert c.messages[1] == {"role": "assistant", "content": None, "tool_calls": [CALL]}  # arguments kept as given
    assert c.messages[2] == {"role": "tool", "content": "21", "tool_call_id": "call_1", "name": "get_weather"}
    assert c.messages[3]["reasoning_content"] == "The tool said 21."
    legacy = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]}
    assert normalise(legacy, "openai", "x", 1).messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    legacy_result = {"messages": [{"role": "user", "content": "q"}, {"role": "function", "name": "f", "content": "1"},
                                  {"role": "assistant", "content": "a"}]}
    assert normalise(legacy_result, "openai", "x", 1).messages[1] == {"role": "tool", "content": "1", "name": "f"}
    plain = normalise({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "openai", "x", 2)
    assert plain.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] and plain.tools is None


def test_sharegpt_agentic_rows_are_normalised():
    rec = {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "Checking again."},
        {"from": "function_call", "value": '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}]'},
        {"from": "observation", "value": '{"temp": 19}'},
        {"from": "gpt", "value": "21 and 19."}],
        "tools": json.dumps([TOOLS[0]["function"]]), "system": "Be helpful."}
    c = normalise(rec, "sharegpt", "x.jsonl", 0)
    assert isinstance(c, Conversation), c
    assert c.tools == TOOLS  # bare function definitions are wrapped
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert c.messages[0]["content"] == "Be helpful."
    assert c.messages[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert c.messages[4]["content"] == "Checking again."  # a gpt turn and the call that follows are one turn
    assert c.messages[4]["tool_calls"][0]["function"]["arguments"] == '{"city": "Lyon"}'


@pytest.mark.parametrize("rec,why", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
     "malformed row: turn 1 (assistant): tool_calls[0] has no function name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                       "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "tool_calls[0] (f): arguments is int"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
     "turn 1 (assistant): missing content"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "get_weather(Paris)"}]},
     "malformed row: turn 1 (assistant): function_call is not valid JSON"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "tools": "[{oops"},
     "malformed row: tools is not valid JSON"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": [{"x": 1}]},
     "malformed row: tool 0 is not a function definition"),
])
def test_malformed_tool_rows_are_rejected_with_their_reason(rec, why):
    r = normalise(rec, "sharegpt" if "conversations" in rec else "openai", "x.jsonl", 0)
    assert isinstance(r, Rejected) and why in r.reason, r


# ------------------------------------------------------------------------------------ prepare

ROWS = [
    {"id": "tool-openai", "tools": TOOLS, "messages": AGENT[1:5]},
    {"id": "tool-sharegpt", "system": "Be helpful.", "tools": json.dumps([TOOLS[0]["function"]]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 21}'}, {"from": "gpt", "value": "It is 21 degrees."}]},
    {"id": "thinking", "messages": AGENT[:2] + AGENT[4:]},
    {"id": "plain", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"id": "bad-call", "messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
]


def _prepare(tiny_target, tmp_path, tokenizer):
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.prepare.stage import prepare

    src = tmp_path / "agentic.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    res = prepare(PrepareConfig(sources=[SourceConfig(path=str(src))], heldout_rows=0, max_length=512),
                  TargetConfig(model=str(tiny_target), tokenizer=str(tokenizer)), tmp_path / "store", log=lambda m: None)
    assert res.rows_in == len(ROWS) == res.rows_out_sources + res.rows_heldout + res.rows_quarantined
    q = {json.loads(line)["row"]: json.loads(line)["reason"] for line in Path(res.quarantine).read_text().splitlines()}
    return res, sorted(load_tokenized(res.tokenized)["sample_id"]), q


def test_prepare_agentic_rows_with_a_tool_template(tiny_target, tmp_path):
    tok = _tok(tiny_target)
    tok.save_pretrained(tmp_path / "tok")
    res, ids, q = _prepare(tiny_target, tmp_path, tmp_path / "tok")
    # tool-sharegpt's first turn has no reasoning: as the last message it renders an empty think
    # block, later the template omits it, so that turn gets a row of its own
    assert ids == ["plain", "thinking#0", "thinking#1", "tool-openai", "tool-sharegpt#0", "tool-sharegpt#1"]
    assert list(q) == [4] and "malformed row: turn 1 (assistant): tool_calls[0] has no function name" in q[4]


def test_prepare_agentic_rows_with_a_template_without_tools(tiny_target, tmp_path):
    res, ids, q = _prepare(tiny_target, tmp_path, tiny_target)
    assert ids == ["plain", "thinking"]  # the tiny template ignores reasoning: nothing is re-rendered
    assert sorted(q) == [0, 1, 4]
    for i in (0, 1):
        assert q[i].startswith("template cannot render tool calls: "), q[i]
    assert res.quarantine_reasons["template cannot render tool calls"] == 2
