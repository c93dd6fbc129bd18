"""The regenerate stage without an engine: which turns the target answers, what is kept verbatim,
how an answer is judged (quarantine kinds), the shard plan and its input hashes, the thinking
switch, and the parent's early errors. The engine side is tests/integration/test_regenerate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import PipelineConfig, RegenerateConfig, SourceConfig, load_config
from eagle3_pipeline.data.formats import RawRow
from eagle3_pipeline.regenerate import turns as T
from eagle3_pipeline.regenerate.stage import plan_shards, prepare_config, regenerate, thinking_kwargs

ROOT = Path(__file__).resolve().parents[2]

CALL = {"id": "call_0", "type": "function", "function": {"name": "find_contact", "arguments": "{\"name\": \"Bo\"}"}}


def agentic() -> list[dict]:
    return [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": "Phone of Bo?"},
        {"role": "assistant", "content": None, "reasoning_content": "I look it up.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "name": "find_contact", "content": "{\"phone\": \"555\"}"},
        {"role": "assistant", "content": "Bo's phone is 555.", "reasoning_content": "Found."},
        {"role": "user", "content": "And Al?"},
        {"role": "assistant", "content": "Al's phone is 556."},
    ]


# ---------------------------------------------------------------- which turns

def test_plain_conversation_every_reply_is_answered_in_order():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]
    plan = T.plan_turns(msgs)
    assert plan.targets == [1, 3] and plan.kept_tool_turns == 0
    assert plan.messages == msgs and plan.messages is not msgs  # a copy: the source is never changed


def test_tool_call_turns_are_kept_text_replies_answered():
    plan = T.plan_turns(agentic())
    assert plan.targets == [4, 6]  # the reply after the tool result and the last reply
    assert plan.kept_tool_turns == 1
    assert plan.messages[2] == agentic()[2]  # the call, its reasoning and content as the data has them


def test_a_trailing_user_turn_or_tool_result_gets_an_answer():
    for last in ({"role": "user", "content": "more?"}, {"role": "tool", "tool_call_id": "call_0", "content": "{}"}):
        plan = T.plan_turns([*agentic(), last] if last["role"] == "user" else [*agentic()[:4], last])
        assert plan.targets[-1] == len(plan.messages) - 1
        assert plan.messages[-1] == {"role": "assistant", "content": None}


def test_max_turns_cuts_after_the_last_answered_reply():
    plan = T.plan_turns(agentic(), max_turns=1)
    assert plan.targets == [4]
    assert [m["role"] for m in plan.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert plan.kept_tool_turns == 1


def test_a_long_history_ends_the_conversation_after_the_turns_answered():
    run = T.ConversationRun("c1", "src.jsonl", 0, None, T.plan_turns(agentic()))
    with pytest.raises(AssertionError):
        run.end_here()  # nothing answered yet: that conversation is quarantined instead
    run.answer("Bo has 555-1.", None)
    run.end_here()  # the next turn's history is past max_history_tokens
    assert run.done and run.problem is None and run.ended_early
    rec = run.record()
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert rec["messages"][4]["content"] == "Bo has 555-1." and rec["regenerated"]["turns"] == [4]
    assert rec["regenerated"]["kept_tool_turns"] == 1 and rec["regenerated"]["cut_turns"] == []


def test_an_answer_that_loops_is_told_from_one_that_does_not():
    loop = [5, 6, 7, 8, 9, 10, 11, 12] * 6  # one sentence over and over
    assert T.repeats_itself([1, 2, 3, 4] + loop)
    assert not T.repeats_itself(list(range(60)))  # every span distinct
    assert not T.repeats_itself(list(range(30)) + [5, 6, 7, 8, 9, 10, 11, 12] * 2)  # a phrase said twice
    assert not T.repeats_itself([3] * 15)  # too short to tell
    assert T.repeats_itself([3] * 40)


@pytest.mark.parametrize("policy", ["keep", "end"])
def test_a_looping_answer_is_kept_and_named_or_ends_the_conversation(policy):
    """regenerate.on_repetition over the worker's judging of one generated answer (no engine: the output
    is what vLLM returns, the target renders nothing that matters here)."""
    from types import SimpleNamespace

    from eagle3_pipeline.regenerate.worker import _take_answer, _Tally

    cfg = RegenerateConfig(on_length="keep", max_tokens=64, on_repetition=policy)
    tally = _Tally(SimpleNamespace(render=lambda *a, **k: "", split=None), cfg, 1024)

    def out(ids, text, finish="stop"):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text, finish_reason=finish)])

    loop = list(range(8)) * 8  # 64 tokens, one 8-token sentence over and over: cut at max_tokens too
    first = T.ConversationRun("c1", "src.jsonl", 0, None, T.plan_turns(agentic()))
    _take_answer(first, "", out(loop, "again " * 64, "length"), tally)  # its first answer loops
    later = T.ConversationRun("c2", "src.jsonl", 1, None, T.plan_turns(agentic()))
    _take_answer(later, "", out(list(range(40)), "Bo has 555."), tally)  # a plain answer, then a loop
    _take_answer(later, "", out(loop, "again " * 64, "length"), tally)
    assert tally.repeating == 2 and tally.answered == (3 if policy == "keep" else 1)
    if policy == "keep":
        assert first.problem is None and first.repeating_turns == [4] and first.cut_turns == [4]
        assert later.done and later.record()["regenerated"]["repeating_turns"] == [6]
        assert tally.cut == {"max_tokens 64": 2}
    else:
        assert first.problem.kind == T.REPEATS and "mostly a loop" in first.problem.reason
        assert first.quarantine_entry()["generated"].startswith("again")
        assert later.problem is None and later.ended_early and later.record()["regenerated"]["turns"] == [4]
        assert later.record()["messages"][-1]["content"] == "Bo has 555." and tally.ended == 1
        assert tally.cut == {} and later.record()["regenerated"]["repeating_turns"] == []


def test_only_tool_calls_passes_through_unchanged():
    msgs = agentic()[:3]  # ends with the assistant's call: nothing to answer
    plan = T.plan_turns(msgs)
    assert plan.targets == [] and plan.messages == msgs


def test_each_turn_is_conditioned_on_the_regenerated_history():
    run = T.ConversationRun("c1", "src.jsonl", 0, None, T.plan_turns(agentic()))
    assert [m["role"] for m in run.history()] == ["system", "user", "assistant", "tool"]
    run.answer("Bo has 555-1.", "The tool said so.")
    assert run.history()[4] == {"role": "assistant", "content": "Bo has 555-1.", "reasoning_content": "The tool said so."}
    assert run.history()[5] == agentic()[5]  # the next user turn follows the regenerated answer
    run.answer("Al has 556-2.", None)
    assert run.done and run.problem is None
    rec = run.record()
    assert rec["messages"][6] == {"role": "assistant", "content": "Al has 556-2."}
    assert rec["messages"][2] == agentic()[2] and rec["messages"][3] == agentic()[3]  # call + result verbatim
    assert rec["regenerated"]["turns"] == [4, 6] and rec["id"] == "c1"


def test_a_failed_turn_quarantines_the_conversation_with_its_reason():
    run = T.ConversationRun("c1", "src.jsonl", 7, None, T.plan_turns(agentic()), raw={"x": 1})
    run.answer("ok", None)
    run.fail(T.Problem(T.EMPTY, "turn 6: nothing"))
    assert run.done
    e = run.quarantine_entry()
    assert (e["source"], e["row"], e["sample_id"], e["kind"], e["raw"]) == ("src.jsonl", 7, "c1", T.EMPTY, {"x": 1})


# ---------------------------------------------------------------- judging an answer

def r1_split(text: str):
    """What vLLM's deepseek_r1 parser does on a complete output (<think>R</think>C)."""
    body = text.partition("<think>")[2] or text
    if "</think>" not in body:
        return body, None
    r, _, c = body.partition("</think>")
    return r, c or None


@pytest.mark.parametrize("text,finish,on_length,split,kind", [
    ("The answer.", "length", "quarantine", None, T.CUT),
    ("", "stop", "quarantine", None, T.EMPTY),
    ("  \n ", "stop", "quarantine", None, T.EMPTY),
    ("partial", "abort", "quarantine", None, T.UNUSABLE),
    (None, None, "quarantine", None, T.UNUSABLE),
    ("<think>I think a lot", "stop", "quarantine", r1_split, T.EMPTY),
    ("<think>I think</think>", "stop", "quarantine", r1_split, T.EMPTY),
])
def test_unusable_answers_are_named(text, finish, on_length, split, kind):
    content, reasoning, problem = T.judge(text, finish, on_length, split, 3, "max_tokens 8")
    assert content is None and problem is not None and problem.kind == kind
    assert problem.reason.startswith("turn 3: ")
    if kind == T.CUT:
        assert "max_tokens 8" in problem.reason
    if split and "I think" in text:
        assert "only reasoning" in problem.reason


def test_usable_answers_keep_text_and_reasoning():
    assert T.judge("Fine.", "stop", "quarantine", None, 1, "x") == ("Fine.", None, None)
    assert T.judge("Cut he", "length", "keep", None, 1, "x") == ("Cut he", None, None)
    assert T.judge("<think>hmm</think>Yes.", "stop", "quarantine", r1_split, 1, "x") == ("Yes.", "hmm", None)


def test_request_seed_depends_on_conversation_and_turn_only():
    a = T.request_seed(0, "c1", 3)
    assert a == T.request_seed(0, "c1", 3)
    assert len({a, T.request_seed(0, "c1", 5), T.request_seed(0, "c2", 3), T.request_seed(1, "c1", 3)}) == 4
    assert 0 <= a < 2**31


# ---------------------------------------------------------------- rows that are not conversations

def _raw(i: int, rec: dict | None, err: str | None = None) -> tuple[str, RawRow]:
    return "auto", RawRow("in.jsonl", i, rec, err, json.dumps(rec).encode())


def test_begin_quarantines_unreadable_and_pretokenized_rows_and_finish_keeps_input_order():
    rows = [_raw(0, {"id": "a", "messages": agentic()}), _raw(1, None, "malformed JSON line: x"),
            _raw(2, {"input_ids": [1, 2], "loss_mask": [0, 1]}), _raw(3, {"id": "b", "messages": [{"role": "user"}]}),
            _raw(4, {"id": "c", "family": "tools", "messages": agentic()[:2]})]
    runs, quarantined = T.begin(rows, None)
    assert [r.sample_id for r in runs] == ["a", "c"]
    assert runs[1].extra == {"family": "tools"}  # a scalar source field is carried over
    kinds = {pos: e["kind"] for pos, e in quarantined}
    assert kinds == {1: T.MALFORMED, 2: T.PRETOKENIZED, 3: T.MALFORMED}
    assert "missing role" in quarantined[2][1]["reason"] or "missing content" in quarantined[2][1]["reason"]
    runs[0].fail(T.Problem(T.PROMPT_TOO_LONG, "turn 4: too long"))
    runs[1].answer("Bo is 555.", None)
    lines, entries = T.finish(runs, quarantined)
    assert [json.loads(x)["id"] for x in lines] == ["c"]
    assert json.loads(lines[0])["family"] == "tools"
    assert [e["row"] for e in entries] == [0, 1, 2, 3]  # every row is in the output or here, in input order
    assert entries[0]["kind"] == T.PROMPT_TOO_LONG and entries[0]["raw"]["id"] == "a"


# ---------------------------------------------------------------- shard plan, thinking, config

def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                                      {"role": "assistant", "content": "a"}]}) + "\n"
                            for i in range(n)))
    return path


def test_shards_cover_every_row_once_and_hash_only_their_rows(tmp_path):
    a, b = _jsonl(tmp_path / "a.jsonl", 5), _jsonl(tmp_path / "b.jsonl", 6)
    srcs = [SourceConfig(path=str(a)), SourceConfig(path=str(b), limit=4)]
    shards = plan_shards(srcs, 3, None)
    assert [(s.row_start, s.row_end) for s in shards] == [(0, 3), (3, 6), (6, 9)]
    lines = b.read_text().splitlines()
    lines[2] = lines[2].replace("q2", "changed")  # global row 7: only the last shard's hash moves
    b.write_text("\n".join(lines) + "\n")
    again = plan_shards(srcs, 3, None)
    assert [s.input_sha == t.input_sha for s, t in zip(shards, again)] == [True, True, False]
    assert plan_shards([SourceConfig(path=str(_jsonl(tmp_path / "e.jsonl", 0)))], 3, None) == []


def test_thinking_switch_is_passed_only_where_the_template_has_it():
    qwen_like = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ messages }}"
    kwargs, note = thinking_kwargs(RegenerateConfig(thinking=False, chat_template_kwargs={"x": 1}), qwen_like)
    assert kwargs == {"x": 1, "enable_thinking": False} and note["applied"] is True
    kwargs, note = thinking_kwargs(RegenerateConfig(thinking=True), "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert kwargs == {} and note["applied"] is False and "no variable 'enable_thinking'" in note["why"]
    kwargs, note = thinking_kwargs(RegenerateConfig(thinking=True, thinking_kwarg="thinking"),
                                   "{% if thinking %}<think>{% endif %}")
    assert kwargs == {"thinking": True} and note["applied"]
    kwargs, note = thinking_kwargs(RegenerateConfig(), qwen_like)
    assert kwargs == {} and note["requested"] is None and note["applied"] is False


def test_config_section_defaults_off_and_rejects_unknown_keys():
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    assert isinstance(cfg, PipelineConfig) and cfg.regenerate.enabled is False
    on = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["regenerate.enabled=true", "regenerate.temperature=0.7"])
    assert on.regenerate.enabled and on.regenerate.temperature == 0.7
    with pytest.raises(ValueError, match="regenerate.temprature: unknown key"):
        load_config(ROOT / "configs" / "tiny-cpu.yaml", ["regenerate.temprature=0.7"])
    with pytest.raises(ValueError, match="regenerate.on_length"):
        load_config(ROOT / "configs" / "tiny-cpu.yaml", ["regenerate.on_length=drop"])


def test_prepare_reads_the_regenerated_rows_instead_of_its_sources():
    from eagle3_pipeline.regenerate.stage import RegenerateResult

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    res = RegenerateResult.model_construct(rows_dir="/store/d/regenerated/v1/rows", version="v1")
    p = prepare_config(cfg.prepare, res)
    assert [(s.path, s.format) for s in p.sources] == [("/store/d/regenerated/v1/rows", "openai")]
    assert p.dataset == cfg.prepare.dataset and p.heldout_rows == cfg.prepare.heldout_rows
    assert len(cfg.prepare.sources) == 2  # the config itself is unchanged


def test_no_template_or_no_rows_fail_before_any_engine(tmp_path, tiny_target):
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"target.model={tiny_target}", f"store={tmp_path}"])
    empty = cfg.prepare.model_copy(update={"sources": [SourceConfig(path=str(_jsonl(tmp_path / "e.jsonl", 0)))]})
    with pytest.raises(ValueError, match="hold no rows"):
        regenerate(cfg.regenerate, empty, cfg.target, tmp_path)
    bare = tmp_path / "no-template"
    bare.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bare / f).write_bytes((Path(tiny_target) / f).read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        regenerate(cfg.regenerate, cfg.prepare, cfg.target.model_copy(update={"tokenizer": str(bare)}), tmp_path)
    assert not (tmp_path / "tiny-chat" / "regenerated").exists()
