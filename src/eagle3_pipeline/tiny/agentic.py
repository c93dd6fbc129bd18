"""Agentic procedural corpus: the dataset of the embedded `tiny-moe` target.

Owns deterministic generation (from a seed) of OpenAI-format conversations: the plain computed-answer
turns of `tiny/corpus.py` plus tool-use conversations (a `tools` list, assistant turns with
`tool_calls` and `content: null`, `tool` results, a final answer computed from the results), and
`reasoning_content` on the assistant turns of *thinking* conversations (every tool-use conversation,
and plain ones whose system prompt asks for it). Writes `openai.jsonl` (all rows) and
`agentic.jsonl` (the tool-use rows only). Reads nothing. `tiny/corpus.py` is only called, never
changed: the tiny Llama's corpus stays byte-identical.

Every answer and every reasoning line follows a fixed phrasing, so a tiny model can learn it and a
draft can predict it; tool results are JSON whose values the final answer copies.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3_pipeline.tiny import corpus

THINKING_SYSTEM = "You are a careful assistant. Think before you answer."
AGENT_SYSTEM = "You are an assistant with tools. Call a tool when you need data."
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul", "Dakar"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"]
CURRENCIES = {"USD": 100, "EUR": 92, "GBP": 79, "JPY": 15000, "CHF": 88}  # units per 100 USD
PEOPLE = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"]


def _fn(name: str, description: str, props: dict[str, tuple[str, str]]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
                       "required": list(props)}}}


TOOLS = {
    "get_weather": _fn("get_weather", "Current weather in a city.", {"city": ("string", "City name")}),
    "convert_currency": _fn("convert_currency", "Convert an amount between currencies.",
                            {"amount": ("integer", "Amount to convert"), "source": ("string", "From code"),
                             "target": ("string", "To code")}),
    "lookup_price": _fn("lookup_price", "Price of a shop item in coins.", {"item": ("string", "Item name")}),
    "calculator": _fn("calculator", "Evaluate an arithmetic expression.",
                      {"expression": ("string", "Expression such as 3 * 4")}),
    "find_contact": _fn("find_contact", "Phone number of a contact.", {"name": ("string", "Contact name")}),
}

# One tool task: (user text, [(tool name, arguments, result)], reasoning before the calls,
# reasoning after the results, final answer)
Task = tuple[str, list[tuple[str, dict, dict]], str, str, str]


def _weather(r: random.Random) -> Task:
    cities = r.sample(CITIES, r.choice([1, 1, 2]))
    calls = [("get_weather", {"city": c}, {"city": c, "temperature_c": r.randint(-5, 35), "sky": r.choice(SKIES)})
             for c in cities]
    if len(cities) == 1:
        q = r.choice([f"What is the weather in {cities[0]}?", f"How is the weather in {cities[0]} today?"])
    else:
        q = f"Compare the weather in {cities[0]} and {cities[1]}."
    answer = " ".join(f"In {res['city']} it is {res['temperature_c']} degrees and {res['sky']}."
                      for _, _, res in calls)
    return (q, calls, f"I need the weather for {' and '.join(cities)}, so I call get_weather.",
            "The tool returned the weather.", answer)


def _currency(r: random.Random) -> Task:
    src, dst = r.sample(sorted(CURRENCIES), 2)
    amount = r.randint(1, 50) * 10
    value = round(amount * CURRENCIES[dst] / CURRENCIES[src], 2)
    res = {"amount": amount, "source": src, "target": dst, "result": value}
    return (f"Convert {amount} {src} to {dst}.", [("convert_currency", {"amount": amount, "source": src,
                                                                         "target": dst}, res)],
            f"I convert {amount} {src} to {dst} with convert_currency.", "The tool returned the result.",
            f"{amount} {src} is {value} {dst}.")


def _price(r: random.Random) -> Task:
    item = r.choice(corpus.ITEMS)
    res = {"item": item, "price": r.randint(1, 60)}
    return (f"How much does the {item} cost in the shop?", [("lookup_price", {"item": item}, res)],
            f"I look up the price of the {item}.", "The tool returned the price.",
            f"The {item} costs {res['price']} coins.")


def _calculator(r: random.Random) -> Task:
    a, b, op = r.randint(10, 99), r.randint(10, 99), r.choice(["+", "-", "*"])
    val = a + b if op == "+" else a - b if op == "-" else a * b
    expr = f"{a} {op} {b}"
    return (f"Use the calculator: {expr}.", [("calculator", {"expression": expr}, {"result": val})],
            f"I evaluate {expr} with the calculator.", "The tool returned the result.",
            f"{expr} = {val}.")


def _contact(r: random.Random) -> Task:
    who = r.choice(PEOPLE)
    phone = f"555-{r.randint(0, 9999):04d}"
    return (f"What is the phone number of {who}?", [("find_contact", {"name": who}, {"name": who, "phone": phone})],
            f"I search the contacts for {who}.", "The tool returned the contact.",
            f"The phone number of {who} is {phone}.")


TOOL_TASKS: dict[str, tuple[str, Callable[[random.Random], Task]]] = {
    "weather": ("get_weather", _weather), "currency": ("convert_currency", _currency),
    "price": ("lookup_price", _price), "calculator": ("calculator", _calculator),
    "contact": ("find_contact", _contact),
}


def _tool_turns(task: Task, first_call: int) -> list[dict]:
    """The assistant's call turn, the tool results and the final answer, in OpenAI format."""
    _, calls, think_call, think_answer, answer = task
    ids = [f"call_{first_call + i}" for i in range(len(calls))]
    msgs = [{"role": "assistant", "content": None, "reasoning_content": think_call, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for cid, (name, args, _) in zip(ids, calls)]}]
    msgs += [{"role": "tool", "tool_call_id": cid, "name": name, "content": json.dumps(res)}
             for cid, (name, _, res) in zip(ids, calls)]
    msgs.append({"role": "assistant", "content": answer, "reasoning_content": think_answer})
    return msgs


def _agentic(r: random.Random) -> dict:
    """1-2 user requests, each answered through tool calls; the tools list offers 2-4 tools."""
    kinds = [r.choice(list(TOOL_TASKS)) for _ in range(r.choices([1, 2], weights=[3, 1])[0])]
    needed = {TOOL_TASKS[k][0] for k in kinds}
    others = [t for t in TOOLS if t not in needed]
    offered = sorted(needed | set(r.sample(others, r.randint(1, 2))), key=list(TOOLS).index)
    msgs = [{"role": "system", "content": AGENT_SYSTEM}] if r.random() < 0.5 else []
    calls = 0
    for k in kinds:
        task = TOOL_TASKS[k][1](r)
        msgs.append({"role": "user", "content": task[0]})
        msgs += _tool_turns(task, calls)
        calls += len(task[1])
    return {"messages": msgs, "tools": [TOOLS[t] for t in offered], "family": "tools:" + kinds[0]}


def _plain(r: random.Random) -> dict:
    """A conversation of tiny/corpus.py; thinking ones carry a reasoning line on every answer."""
    c = corpus.conversation(r)
    thinking = c["family"] != "lookup" and r.random() < 0.4
    system = THINKING_SYSTEM if thinking else c["system"]
    msgs = [{"role": "system", "content": system}] if system else []
    for u, a in c["turns"]:
        msgs.append({"role": "user", "content": u})
        m = {"role": "assistant", "content": a}
        if thinking:
            m["reasoning_content"] = f"The question is: {u} I answer in one sentence."
        msgs.append(m)
    return {"messages": msgs, "family": c["family"] + (":think" if thinking else "")}


def generate(n: int, seed: int, tool_fraction: float = 0.4) -> Iterator[dict]:
    """`n` OpenAI rows (`id`, `messages`, optional `tools`, `family`), identical for identical args."""
    r = random.Random(seed)
    for i in range(n):
        row = _agentic(r) if r.random() < tool_fraction else _plain(r)
        yield {"id": f"tiny-moe-{seed}-{i:06d}", **row}


def write_corpus(out_dir: Path, n: int, seed: int, tool_fraction: float = 0.4) -> dict[str, Path]:
    """`openai.jsonl` (every row) and `agentic.jsonl` (the rows with tools). Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"openai": out_dir / "openai.jsonl", "agentic": out_dir / "agentic.jsonl"}
    with paths["openai"].open("w") as fo, paths["agentic"].open("w") as fa:
        for row in generate(n, seed, tool_fraction):
            line = json.dumps(row) + "\n"
            fo.write(line)
            if "tools" in row:
                fa.write(line)
    return paths
