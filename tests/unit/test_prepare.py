"""prepare: every input row ends up in the output, the held-out set or the quarantine, with its reason."""

import json
from pathlib import Path

from eagle3_pipeline.core.config import PrepareConfig, SourceConfig, TargetConfig
from eagle3_pipeline.prepare.stage import prepare


def _good(i):
    return {"id": f"g{i}", "messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                        {"role": "assistant", "content": f"{i} + 1 = {i + 1}."}]}


BAD = [  # (json line, reason fragment)
    ('{"id": "x1", "messages": [{"role": "user", "content": "hi"', "malformed JSON"),
    (json.dumps({"id": "x2", "messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}), "missing role"),
    (json.dumps({"id": "x3", "messages": [{"role": "wizard", "content": "hi"}]}), "unknown role"),
    (json.dumps({"id": "x4", "messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "a"}]}), "empty content"),
    (json.dumps({"id": "x5", "messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "a"}]}), "malformed row"),
    (json.dumps({"id": "x6", "messages": [{"role": "user", "content": "hello"}]}), "no assistant turn"),
    (json.dumps({"id": "x7", "messages": [{"role": "user", "content": "long " * 400}, {"role": "assistant", "content": "ok"}]}), "over-length prompt"),
    (json.dumps({"id": "g0", "messages": [{"role": "user", "content": "dup"}, {"role": "assistant", "content": "dup"}]}), "duplicate id"),
    (json.dumps({"id": "x9", "input_ids": [1, 2, 99999], "loss_mask": [0, 1, 1]}), "outside the tokenizer's vocab"),
    (json.dumps({"id": "x10", "input_ids": [1, 2], "loss_mask": [0]}), "loss_mask"),
    (json.dumps({"id": "x11", "text": "plain"}), "unknown format"),
]


def test_quarantine_invariant_and_reasons(tiny_target, tmp_path):
    src = tmp_path / "mixed.jsonl"
    lines = [json.dumps(_good(i)) for i in range(30)] + [b for b, _ in BAD]
    src.write_text("\n".join(lines) + "\n")
    sharegpt = tmp_path / "sg.json"  # a .json file in ShareGPT format, with list-of-parts elsewhere
    sharegpt.write_text(json.dumps([{"id": "s1", "conversations": [{"from": "system", "value": "be brief"},
                                    {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]))
    parts = tmp_path / "parts.jsonl"
    parts.write_text(json.dumps({"id": "p1", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "tool", "content": "result"}, {"role": "assistant", "content": "done"}]}) + "\n")
    cfg = PrepareConfig(sources=[SourceConfig(path=str(src)), SourceConfig(path=str(sharegpt)),
                                 SourceConfig(path=str(parts))], max_length=64, heldout_rows=3)
    res = prepare(cfg, TargetConfig(model=str(tiny_target), tokenizer=str(tiny_target)), tmp_path / "store")
    assert res.rows_in == 30 + len(BAD) + 2
    assert res.rows_in == res.rows_out + res.rows_heldout + res.rows_quarantined
    assert res.rows_heldout == 3 and res.rows_quarantined == len(BAD)
    q = [json.loads(line) for line in Path(res.quarantine).read_text().splitlines()]
    for (_, why), rec in zip(BAD, sorted(q, key=lambda r: r["row"])):
        assert why in rec["reason"], (why, rec)
        assert rec["source"].endswith("mixed.jsonl")
    from eagle3_pipeline.data.tokenized import load_tokenized

    ds = load_tokenized(res.tokenized)
    assert ds.features["input_ids"].feature.dtype == "int64" and ds.features["seq_len"].dtype == "int64"
    assert all(len(r["input_ids"]) == r["seq_len"] == len(r["loss_mask"]) and sum(r["loss_mask"]) > 0 for r in ds)
    assert {"s1", "p1"} <= set(ds["sample_id"]) | {json.loads(h)["sample_id"] for h in Path(res.heldout).read_text().splitlines()}


def test_same_inputs_same_version_new_template_new_version(tiny_target, tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps(_good(i)) + "\n" for i in range(10)))
    cfg = PrepareConfig(sources=[SourceConfig(path=str(src))], heldout_rows=2)
    tgt = TargetConfig(model=str(tiny_target))
    first = prepare(cfg, tgt, tmp_path / "store")
    again = prepare(cfg, tgt, tmp_path / "store")
    assert again.cached and again.version == first.version
    other = prepare(cfg.model_copy(update={"max_length": 100}), tgt, tmp_path / "store")
    assert other.version != first.version and Path(first.tokenized).exists()


def test_refresh_with_appended_rows_tokenizes_only_new_chunks(tiny_target, tmp_path):
    src = tmp_path / "daily.jsonl"
    src.write_text("".join(json.dumps(_good(i)) + "\n" for i in range(25)))
    cfg = PrepareConfig(sources=[SourceConfig(path=str(src))], heldout_rows=2, chunk_rows=10)
    tgt = TargetConfig(model=str(tiny_target))
    first = prepare(cfg, tgt, tmp_path / "store")
    assert (first.chunks_total, first.chunks_computed) == (3, 3)
    chunk_dir = tmp_path / "store" / "default" / "_chunks"
    mtimes = {p.name: (p / "rows.parquet").stat().st_mtime_ns for p in chunk_dir.iterdir()}
    with src.open("a") as f:  # the nightly refresh appends 12 rows
        f.write("".join(json.dumps(_good(i)) + "\n" for i in range(25, 37)))
    second = prepare(cfg, tgt, tmp_path / "store")
    # chunks [0,10) and [10,20) are unchanged; [20,30) changed (it grew), [30,37) is new
    assert (second.chunks_total, second.chunks_computed) == (4, 2)
    assert second.version != first.version and Path(first.tokenized).exists()
    assert second.rows_in == 37 == second.rows_out + second.rows_heldout + second.rows_quarantined
    now = {p.name: (p / "rows.parquet").stat().st_mtime_ns for p in chunk_dir.iterdir()}
    assert all(now[k] == mtimes[k] for k in mtimes)  # no old chunk was rewritten
    assert len(set(now) - set(mtimes)) == 2  # exactly two new chunks were written


def test_rows_per_turn_keeps_the_invariant_in_source_rows(tiny_target, tmp_path):
    conv = {"id": "m1", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps(conv) + "\n" + "".join(json.dumps(_good(i)) + "\n" for i in range(5)))
    cfg = PrepareConfig(sources=[SourceConfig(path=str(src))], heldout_rows=0, rows_per="turn")
    res = prepare(cfg, TargetConfig(model=str(tiny_target)), tmp_path / "store")
    assert res.rows_out == 7 and res.rows_out_sources == 6 == res.rows_in
    from eagle3_pipeline.data.tokenized import load_tokenized

    assert {"m1#0", "m1#1"} <= set(load_tokenized(res.tokenized)["sample_id"])


def test_hub_dataset_offline_error_names_the_dataset(tiny_target, tmp_path, monkeypatch):
    import pytest

    from eagle3_pipeline.data.formats import SourceError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = PrepareConfig(sources=[SourceConfig(path="someorg/chat-data", split="train", revision="v2")])
    with pytest.raises(SourceError, match="someorg/chat-data.*hub.*split 'train', revision 'v2'"):
        prepare(cfg, TargetConfig(model=str(tiny_target)), tmp_path / "store")


def test_missing_local_source_is_a_clear_error(tiny_target, tmp_path):
    import pytest

    from eagle3_pipeline.data.formats import SourceError

    cfg = PrepareConfig(sources=[SourceConfig(path=str(tmp_path / "nope.jsonl"))])
    with pytest.raises(SourceError, match="nope.jsonl does not exist"):
        prepare(cfg, TargetConfig(model=str(tiny_target)), tmp_path / "store")


def test_two_processes_give_the_same_bytes(tiny_target, tmp_path):
    from eagle3_pipeline.data.tokenized import load_tokenized

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps(_good(i)) + "\n" for i in range(30)))
    tgt = TargetConfig(model=str(tiny_target))
    one = prepare(PrepareConfig(sources=[SourceConfig(path=str(src))], chunk_rows=8), tgt, tmp_path / "s1")
    two = prepare(PrepareConfig(sources=[SourceConfig(path=str(src))], chunk_rows=8, num_proc=2), tgt, tmp_path / "s2")
    assert one.version == two.version
    assert load_tokenized(one.tokenized).to_dict() == load_tokenized(two.tokenized).to_dict()


def test_chat_data_as_it_comes_is_trimmed_and_counted(tiny_target, tmp_path):
    """ShareGPT V3's shapes: a piece that opens with the assistant's answer, an empty turn, a trailing
    question, the chatgpt/bing/bard speakers. The row keeps what can be supervised and prepare.json
    counts every turn left out by its reason; a row with nothing left is quarantined saying why."""
    from eagle3_pipeline.data.formats import TRIM_AFTER_EMPTY, TRIM_LEADING, TRIM_TRAILING
    from eagle3_pipeline.data.tokenized import load_tokenized

    def conv(i, *turns):
        return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}

    rows = [
        conv(0, ("gpt", "the end of an earlier answer"), ("human", "What is 2 + 2?"), ("gpt", "4.")),
        conv(1, ("system", "be brief"), ("gpt", "dangling"), ("gpt", "more"), ("human", "hi"), ("chatgpt", "hello")),
        conv(2, ("human", "q1"), ("bing", "a1"), ("human", ""), ("bard", "a2"), ("human", "q3"), ("gpt", "a3")),
        conv(3, ("human", "q1"), ("gpt", "a1"), ("human", "and then?")),
        conv(4, ("gpt", "only an answer")),
        conv(5, ("human", " "), ("gpt", "an answer to nothing")),
        conv(6, ("human", "plain"), ("gpt", "row")),
    ]
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(rows))
    res = prepare(PrepareConfig(sources=[SourceConfig(path=str(src))], max_length=128, heldout_rows=0),
                  TargetConfig(model=str(tiny_target)), tmp_path / "store")
    assert res.rows_in == 7 and res.rows_out == 5 and res.rows_quarantined == 2
    assert res.rows_trimmed == 4 and res.turns_trimmed == 3 + 4 + 1
    assert res.trim_reasons == {TRIM_LEADING: 3, TRIM_AFTER_EMPTY: 4, TRIM_TRAILING: 1}
    q = {r["row"]: r["reason"] for r in map(json.loads, Path(res.quarantine).read_text().splitlines())}
    assert q == {4: "no assistant turn after a user turn (1 turn(s), none answers a user turn)",
                 5: "turn 0 (user): empty content, and no answered user turn before it"}
    ds = load_tokenized(res.tokenized)
    assert sorted(ds["sample_id"]) == ["c0", "c1", "c2", "c3", "c6"]
    assert json.loads((Path(res.dir) / "prepare.json").read_text())["trim_reasons"] == res.trim_reasons


def test_a_copied_store_reads_its_own_files(tiny_target, tmp_path):
    """A store copied or moved (another machine, another mount point) whose prepare version is complete: the reused
    record names the files of the copy, not of the store it was copied from (which may be gone, or be another's)."""
    import shutil

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps(_good(i)) + "\n" for i in range(10)))
    cfg = PrepareConfig(sources=[SourceConfig(path=str(src))], heldout_rows=2)
    tgt = TargetConfig(model=str(tiny_target))
    first = prepare(cfg, tgt, tmp_path / "store")
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    shutil.rmtree(tmp_path / "store")
    lines: list[str] = []
    again = prepare(cfg, tgt, tmp_path / "copy", log=lines.append)
    assert again.cached and again.version == first.version
    copy = (tmp_path / "copy").resolve()
    for name in ("dir", "tokenized", "token_freq", "heldout", "quarantine"):
        assert Path(getattr(again, name)).is_relative_to(copy) and Path(getattr(again, name)).exists(), name
    assert any("was written at" in x for x in lines), lines  # the move is said, not silent
