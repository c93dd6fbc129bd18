"""MT-Bench-style categorized prompt sets for the embedded tiny targets (evaluate.prompts).

Owns `chat_set(...)` (the tiny Llama's domain, `tiny/corpus.py`) and `agentic_set(...)` (the tiny
MoE's, `tiny/agentic.py`: the same families plus thinking and tool use) and `write_prompt_sets(dir)`,
which writes them as `configs/prompts/tiny-chat.jsonl` and `configs/prompts/tiny-agentic.jsonl`
(committed, so a user can read them; tests/unit/test_eval_prompts.py checks that the committed files
are what this module generates). Reads nothing; deterministic (fixed seeds).

The tiny models know nothing but their procedural corpus, so a prompt set that measures their drafts
must ask what the corpus asks, in its phrasing: every prompt comes from the corpus' own generators
(from seeds other than the corpus', although the small families repeat questions anyway). A row is
one of the forms `evaluate.prompts` reads (evaluate/prompts.py):
  {"id", "category", "prompt": str, "reference"}                    single user turn
  {"id", "category", "messages": [...], "tools"?, "reference"}      a conversation so far (system
                                                                    prompt, earlier turns, tool results)
`reference` is the corpus' answer (the evaluation does not read it; it is there for the reader).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3_pipeline.tiny import agentic, corpus

PER_CATEGORY = 6
CHAT_FILE, AGENTIC_FILE = "tiny-chat.jsonl", "tiny-agentic.jsonl"
SEED = 20_261_201


def _unique(make: Callable[[random.Random], dict], r: random.Random, n: int) -> Iterator[dict]:
    """n rows of `make` with distinct prompts (the families are small: retry duplicates)."""
    seen: set[str] = set()
    for _ in range(50 * n):
        row = make(r)
        key = json.dumps(row.get("messages") or row["prompt"], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        yield row
        if len(seen) == n:
            return
    raise RuntimeError(f"prompt_sets: could not draw {n} distinct prompts")


def _single(family: str) -> Callable[[random.Random], dict]:
    def make(r: random.Random) -> dict:
        q, a = corpus.FAMILIES[family](r)
        return {"prompt": q, "reference": a}
    return make


def _lookup(r: random.Random) -> dict:
    """A price table in the system prompt, one question about it (corpus._table_conversation)."""
    c = corpus._table_conversation(r)
    q, a = c["turns"][0]
    return {"messages": [{"role": "system", "content": c["system"]}, {"role": "user", "content": q}], "reference": a}


def _multi_turn(r: random.Random) -> dict:
    """Two answered turns of one family, then a third question (the corpus' multi-turn shape)."""
    fam = r.choice(list(corpus.FAMILIES))
    msgs: list[dict] = []
    for _ in range(2):
        q, a = corpus.FAMILIES[fam](r)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    q, a = corpus.FAMILIES[fam](r)
    return {"messages": msgs + [{"role": "user", "content": q}], "reference": a}


def _thinking(r: random.Random) -> dict:
    """A plain question under the thinking system prompt (the MoE answers with a reasoning line)."""
    q, a = corpus.FAMILIES[r.choice(list(corpus.FAMILIES))](r)
    return {"messages": [{"role": "system", "content": agentic.THINKING_SYSTEM}, {"role": "user", "content": q}],
            "reference": a}


def _tool_task(r: random.Random) -> tuple[list[dict], list[dict], agentic.Task]:
    """(system + user messages, offered tools, the task) of one single-request tool conversation."""
    kind = r.choice(list(agentic.TOOL_TASKS))
    needed = agentic.TOOL_TASKS[kind][0]
    others = [t for t in agentic.TOOLS if t != needed]
    offered = sorted({needed, *r.sample(others, r.randint(1, 2))}, key=list(agentic.TOOLS).index)
    task = agentic.TOOL_TASKS[kind][1](r)
    msgs = [{"role": "system", "content": agentic.AGENT_SYSTEM}] if r.random() < 0.5 else []
    return msgs + [{"role": "user", "content": task[0]}], [agentic.TOOLS[t] for t in offered], task


def _tool_call(r: random.Random) -> dict:
    """The request: the model has to reason and emit the tool call(s)."""
    msgs, tools, task = _tool_task(r)
    calls = "; ".join(f"{name} {json.dumps(args)}" for name, args, _ in task[1])
    return {"messages": msgs, "tools": tools, "reference": calls}


def _tool_answer(r: random.Random) -> dict:
    """The request, the call and the tool result(s): the model has to write the final answer."""
    msgs, tools, task = _tool_task(r)
    turns = agentic._tool_turns(task, 0)  # [call turn, tool results..., final answer]
    return {"messages": msgs + turns[:-1], "tools": tools, "reference": turns[-1]["content"]}


CHAT_CATEGORIES: dict[str, Callable[[random.Random], dict]] = {
    "arithmetic": _single("arithmetic"), "units": _single("units"), "sorting": _single("sorting"),
    "strings": _single("strings"), "dates": _single("dates"), "lookup": _lookup, "multi-turn": _multi_turn,
}
AGENTIC_CATEGORIES: dict[str, Callable[[random.Random], dict]] = {
    **{k: v for k, v in CHAT_CATEGORIES.items() if k != "multi-turn"},
    "thinking": _thinking, "tool-call": _tool_call, "tool-answer": _tool_answer,
}


def _build(name: str, categories: dict[str, Callable[[random.Random], dict]], per_category: int,
           seed: int) -> list[dict]:
    rows = []
    for c, (cat, make) in enumerate(categories.items()):
        r = random.Random(seed + 1000 * c)
        for i, row in enumerate(_unique(make, r, per_category)):
            rows.append({"id": f"{name}-{cat}-{i}", "category": cat, **row})
    return rows


def chat_set(per_category: int = PER_CATEGORY, seed: int = SEED) -> list[dict]:
    """Prompts for the tiny Llama (configs/tiny-cpu.yaml): 7 categories of tiny/corpus.py."""
    return _build("chat", CHAT_CATEGORIES, per_category, seed)


def agentic_set(per_category: int = PER_CATEGORY, seed: int = SEED) -> list[dict]:
    """Prompts for the tiny MoE (configs/tiny-moe.yaml): 6 plain categories, thinking and tool use."""
    return _build("agentic", AGENTIC_CATEGORIES, per_category, seed + 1)


def render_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_prompt_sets(out_dir: Path) -> dict[str, Path]:
    """Write both sets into `out_dir` (the repository keeps them in configs/prompts/)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {CHAT_FILE: out_dir / CHAT_FILE, AGENTIC_FILE: out_dir / AGENTIC_FILE}
    paths[CHAT_FILE].write_text(render_jsonl(chat_set()))
    paths[AGENTIC_FILE].write_text(render_jsonl(agentic_set()))
    return paths


if __name__ == "__main__":  # python -m eagle3_pipeline.tiny.prompt_sets [DIR]: regenerate the committed files
    import sys

    for p in write_prompt_sets(Path(sys.argv[1] if len(sys.argv) > 1 else "configs/prompts")).values():
        print(p)
