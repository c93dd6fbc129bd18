"""Procedural chat corpus: the embedded default dataset.

Owns: deterministic generation (from a seed) of multi-turn conversations whose assistant answers are
*computed* (arithmetic, unit conversion, sorting, string edits, date arithmetic, table lookups), and
writing them as ShareGPT (`conversations`, `from`/`value`) and OpenAI (`messages`, `role`/`content`)
JSONL files. Reads nothing. Every answer follows a fixed phrasing so a tiny model can learn it and a
draft model can predict it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "garden", "rocket", "candle",
         "forest", "silver", "window", "dragon", "pepper", "castle", "butter", "planet", "orange", "mirror"]
ITEMS = ["pen", "cup", "lamp", "book", "shoe", "kite", "bell", "coin", "drum", "fork", "hat", "key"]
UNITS = [  # (from, to, factor)
    ("km", "meters", 1000), ("m", "centimeters", 100), ("kg", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000),
    ("days", "hours", 24), ("weeks", "days", 7),
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer briefly.",
    "You are a precise calculator assistant.",
    "You answer questions with short, exact sentences.",
]

Turn = tuple[str, str]  # (user text, assistant text)


def _arithmetic(r: random.Random) -> Turn:
    # small operands: a tiny model can learn these facts within its build budget
    op = r.choice(["+", "-", "*"])
    a, b = (r.randint(2, 12), r.randint(2, 12)) if op == "*" else (r.randint(1, 20), r.randint(1, 20))
    val = a + b if op == "+" else a - b if op == "-" else a * b
    q = r.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"Calculate {a} {op} {b} please."])
    return q, f"{a} {op} {b} = {val}. The answer is {val}."


def _units(r: random.Random) -> Turn:
    src, dst, f = r.choice(UNITS)
    n = r.randint(1, 12)
    return f"Convert {n} {src} to {dst}.", f"{n} {src} is {n * f} {dst}."


def _sorting(r: random.Random) -> Turn:
    nums = [r.randint(0, 30) for _ in range(r.randint(3, 5))]
    order = r.choice(["ascending", "descending"])
    out = sorted(nums, reverse=order == "descending")
    return (f"Sort these numbers in {order} order: {', '.join(map(str, nums))}.",
            f"In {order} order: {', '.join(map(str, out))}.")


def _strings(r: random.Random) -> Turn:
    w = r.choice(WORDS)
    kind = r.choice(["reverse", "upper", "length", "first"])
    if kind == "reverse":
        return f"Reverse the word {w}.", f"The word {w} reversed is {w[::-1]}."
    if kind == "upper":
        return f"Write {w} in capital letters.", f"In capital letters, {w} is {w.upper()}."
    if kind == "length":
        return f"How many letters are in {w}?", f"The word {w} has {len(w)} letters."
    return f"What is the first letter of {w}?", f"The first letter of {w} is {w[0]}."


def _dates(r: random.Random) -> Turn:
    if r.random() < 0.5:
        d, n = r.randrange(7), r.randint(1, 13)
        return (f"What day is {n} days after {WEEKDAYS[d]}?",
                f"{n} days after {WEEKDAYS[d]} is {WEEKDAYS[(d + n) % 7]}.")
    m = r.randrange(12)
    return f"How many days are in {MONTHS[m]}?", f"{MONTHS[m]} has {MONTH_DAYS[m]} days."


FAMILIES: dict[str, Callable[[random.Random], Turn]] = {
    "arithmetic": _arithmetic, "units": _units, "sorting": _sorting,
    "strings": _strings, "dates": _dates,
}


def _table_conversation(r: random.Random) -> dict:
    """A lookup task: the system prompt holds a generated price table, users ask about rows of it."""
    items = r.sample(ITEMS, 4)
    prices = {it: r.randint(1, 50) for it in items}
    table = "; ".join(f"{it} costs {p} coins" for it, p in prices.items())
    turns = []
    for it in r.sample(items, r.randint(1, 3)):
        turns.append((f"How much does the {it} cost?", f"The {it} costs {prices[it]} coins."))
    return {"system": f"Price list: {table}.", "turns": turns, "family": "lookup"}


def conversation(r: random.Random) -> dict:
    """One conversation: optional system prompt and 1-3 user/assistant turns of one or more families."""
    if r.random() < 0.15:
        return _table_conversation(r)
    fam = r.choice(list(FAMILIES))
    n_turns = r.choices([1, 2, 3], weights=[5, 3, 2])[0]
    turns = [FAMILIES[fam if r.random() < 0.7 else r.choice(list(FAMILIES))](r) for _ in range(n_turns)]
    system = r.choice(SYSTEM_PROMPTS) if r.random() < 0.4 else None
    return {"system": system, "turns": turns, "family": fam}


def generate(n: int, seed: int) -> Iterator[dict]:
    """`n` conversations, identical for identical (n, seed)."""
    r = random.Random(seed)
    for i in range(n):
        c = conversation(r)
        c["id"] = f"tiny-{seed}-{i:06d}"
        yield c


def to_openai(c: dict) -> dict:
    msgs = [{"role": "system", "content": c["system"]}] if c["system"] else []
    for u, a in c["turns"]:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return {"id": c["id"], "messages": msgs}


def to_sharegpt(c: dict) -> dict:
    conv = [{"from": "system", "value": c["system"]}] if c["system"] else []
    for u, a in c["turns"]:
        conv += [{"from": "human", "value": u}, {"from": "gpt", "value": a}]
    return {"id": c["id"], "conversations": conv}


def write_corpus(out_dir: Path, n: int, seed: int) -> dict[str, Path]:
    """Write the corpus split in two halves: `sharegpt.jsonl` and `openai.jsonl`. Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"sharegpt": out_dir / "sharegpt.jsonl", "openai": out_dir / "openai.jsonl"}
    with paths["sharegpt"].open("w") as fs, paths["openai"].open("w") as fo:
        for i, c in enumerate(generate(n, seed)):
            if i % 2 == 0:
                fs.write(json.dumps(to_sharegpt(c)) + "\n")
            else:
                fo.write(json.dumps(to_openai(c)) + "\n")
    return paths
