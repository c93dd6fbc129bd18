"""Which assistant turns the target answers, what is kept, and when a conversation is quarantined.

More: docs/internals.md, "regenerate/turns.py".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3_pipeline.data.formats import Conversation, Pretokenized, Rejected, parse_row

# Quarantine kinds (the `kind` of an entry in quarantine.jsonl; counted in the stage record).
MALFORMED = "malformed row"             # the source row could not be read as a conversation (formats.py reason)
PRETOKENIZED = "pretokenized row"       # input_ids + loss_mask only: no messages to answer
TEMPLATE = "template error"             # the chat template raised on the history
PROMPT_TOO_LONG = "prompt too long"     # history + generation prompt does not fit max_model_len
CUT = "cut at max_tokens"               # finish_reason length (on_length: quarantine)
EMPTY = "empty answer"                  # nothing but whitespace (or only reasoning) was generated
UNUSABLE = "no usable text"             # a finish reason that leaves no answer (abort, error)
REPEATS = "answer repeats itself"       # the first answer is mostly a loop (on_repetition: end)
QUARANTINE_KINDS = (MALFORMED, PRETOKENIZED, TEMPLATE, PROMPT_TOO_LONG, CUT, EMPTY, UNUSABLE, REPEATS)


@dataclass
class Problem:
    kind: str
    reason: str
    generated: str | None = None  # what the target generated, when it generated something (cut to 1000 chars)


@dataclass
class TurnPlan:
    """What happens to one conversation. `messages` is what will be written: the source messages up
    to the cut, plus the appended turn when the conversation ends with a user turn or a tool result;
    the turns at `targets` are replaced as the target answers them."""
    messages: list[dict]
    targets: list[int]  # message indices the target answers, in order
    kept_tool_turns: int  # assistant turns with tool calls kept verbatim (before the cut)


def plan_turns(messages: list[dict], max_turns: int | None = None) -> TurnPlan:
    """The plan of one normalised conversation (see the module docstring)."""
    msgs = [dict(m) for m in messages]
    if msgs and msgs[-1]["role"] in ("user", "tool"):
        msgs.append({"role": "assistant", "content": None})  # the target answers the last message too
    targets = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and not m.get("tool_calls")]
    if max_turns is not None and len(targets) > max_turns:
        targets = targets[:max_turns]
        msgs = msgs[: targets[-1] + 1]
    kept = sum(1 for m in msgs if m["role"] == "assistant" and m.get("tool_calls"))
    return TurnPlan(msgs, targets, kept)


def request_seed(seed: int, sample_id: str, turn: int) -> int:
    """The sampling seed of one request: a function of the configured seed, the conversation and the
    turn only, so an answer does not depend on the batch, the shard plan or a rerun."""
    h = hashlib.sha256(f"{seed}|{sample_id}|{turn}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def judge(text: str | None, finish_reason: str | None, on_length: str,
          split: Callable[[str], tuple[str | None, str | None]] | None, turn: int, limit: str
          ) -> tuple[str | None, str | None, Problem | None]:
    """(content, reasoning, problem) of one generated answer. `split` is the reasoning parser
    (text -> (reasoning, content)); `limit` names what a `length` finish hit (for the reason)."""
    gen = text[:1000] if text else None
    if finish_reason == "length" and on_length == "quarantine":
        return None, None, Problem(CUT, f"turn {turn}: the answer was cut at {limit} (finish_reason length; "
                                        f"regenerate.on_length: quarantine)", gen)
    if finish_reason not in ("stop", "length"):
        return None, None, Problem(UNUSABLE, f"turn {turn}: finish_reason {finish_reason!r} leaves no usable answer", gen)
    text = text or ""
    reasoning, content = split(text) if split else (None, text)
    if content is None or not content.strip():
        what = f"only reasoning ({len(reasoning)} characters), no answer after it" if reasoning and reasoning.strip() \
            else "nothing but whitespace"
        return None, None, Problem(EMPTY, f"turn {turn}: the target generated {what} (finish_reason {finish_reason})",
                                   gen)
    return content, (reasoning if reasoning and reasoning.strip() else None), None


REPEAT_SPAN = 8  # tokens of the spans repeats_itself compares
REPEAT_DISTINCT = 0.5  # an answer with fewer distinct spans than this share of its spans repeats itself


def repeats_itself(ids: list[int]) -> bool:
    """Whether a generated answer is mostly a loop: fewer than REPEAT_DISTINCT of its REPEAT_SPAN-token spans
    are distinct (greedy decoding of a small target falls into such loops; a draft trained on them learns
    loops). Answers shorter than two spans never count."""
    spans = [tuple(ids[i:i + REPEAT_SPAN]) for i in range(len(ids) - REPEAT_SPAN + 1)]
    return len(spans) > REPEAT_SPAN and len(set(spans)) < REPEAT_DISTINCT * len(spans)


@dataclass
class ConversationRun:
    """One conversation being regenerated: its plan, the next turn to answer, and its outcome."""
    sample_id: str
    source: str
    row: int
    tools: list[dict] | None
    plan: TurnPlan
    extra: dict = field(default_factory=dict)  # source fields written back unchanged (e.g. a category)
    position: int = 0  # place in its shard (outputs are written in input order)
    raw: object = None  # the source record (kept in a quarantine entry)
    k: int = 0  # index into plan.targets of the next turn
    problem: Problem | None = None
    generated_tokens: int = 0
    cut_turns: list[int] = field(default_factory=list)  # answered turns cut short (on_length: keep)
    repeating_turns: list[int] = field(default_factory=list)  # answered turns that repeat themselves (repeats_itself)
    ended_early: bool = False  # ended before a turn (end_here: its history was too long, or its answer looped)

    @property
    def done(self) -> bool:
        return self.problem is not None or self.k >= len(self.plan.targets)

    @property
    def turn(self) -> int:
        """Message index of the next turn to answer."""
        return self.plan.targets[self.k]

    def history(self) -> list[dict]:
        """The messages the target answers next (everything before the turn, answered turns replaced)."""
        return self.plan.messages[: self.turn]

    def answer(self, content: str, reasoning: str | None) -> None:
        msg = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        self.plan.messages[self.turn] = msg
        self.k += 1

    def fail(self, problem: Problem) -> None:
        self.problem = problem

    def end_here(self) -> None:
        """End the conversation before the next turn (its history grew past regenerate.max_history_tokens, or
        its answer looped under on_repetition: end):
        the turns answered so far are kept, what followed them is cut (as max_turns cuts)."""
        assert self.k > 0, "a conversation with no answered turn is quarantined, not ended"
        self.plan.messages = self.plan.messages[: self.plan.targets[self.k - 1] + 1]
        self.plan.targets = self.plan.targets[: self.k]
        self.plan.kept_tool_turns = sum(1 for m in self.plan.messages if m["role"] == "assistant" and m.get("tool_calls"))
        self.ended_early = True

    def record(self) -> dict:
        """The output row (OpenAI format; prepare reads it like any source row)."""
        rec = {"id": self.sample_id, "messages": self.plan.messages}
        if self.tools:
            rec["tools"] = self.tools
        rec["regenerated"] = {"turns": self.plan.targets, "kept_tool_turns": self.plan.kept_tool_turns,
                              "source": self.source, "row": self.row, "generated_tokens": self.generated_tokens,
                              "cut_turns": self.cut_turns, "repeating_turns": self.repeating_turns}
        return {**self.extra, **rec}

    def quarantine_entry(self) -> dict:
        assert self.problem is not None
        return quarantine_entry(self.source, self.row, self.problem, self.raw, self.sample_id)


# top-level source fields that are structure, not data to carry over into a regenerated row
STRUCTURE_KEYS = frozenset({"id", "sample_id", "messages", "conversations", "tools", "system", "regenerated"})


def begin(rows: list[tuple[str, object]], max_turns: int | None) -> tuple[list[ConversationRun], list[tuple[int, dict]]]:
    """Parse a shard's raw rows ((format, formats.RawRow) pairs): a ConversationRun per conversation, and
    (position, quarantine entry) for every row that is none (unreadable, pre-tokenized)."""
    runs: list[ConversationRun] = []
    quarantined: list[tuple[int, dict]] = []
    for pos, (fmt, raw) in enumerate(rows):
        item = parse_row(raw, fmt, require_assistant=False)  # a prompt-only conversation is answered
        if isinstance(item, Rejected):
            quarantined.append((pos, quarantine_entry(item.source, item.row, Problem(MALFORMED, item.reason), item.raw)))
        elif isinstance(item, Pretokenized):
            quarantined.append((pos, quarantine_entry(item.source, item.row, Problem(
                PRETOKENIZED, "pre-tokenized row (input_ids + loss_mask): no messages for the target to answer"),
                raw.rec, item.sample_id)))
        else:
            assert isinstance(item, Conversation)
            extra = {k: v for k, v in (raw.rec or {}).items()
                     if k not in STRUCTURE_KEYS and isinstance(v, (str, int, float, bool))}
            runs.append(ConversationRun(item.sample_id, item.source, item.row, item.tools,
                                        plan_turns(item.messages, max_turns), extra, position=pos, raw=raw.rec))
    return runs, quarantined


def finish(runs: list[ConversationRun], quarantined: list[tuple[int, dict]]) -> tuple[list[str], list[dict]]:
    """A shard's output lines (rows answered in full, input order) and quarantine entries (input order)."""
    rows = sorted((c.position, dumps_row(c.record())) for c in runs if c.problem is None)
    q = sorted([*quarantined, *((c.position, c.quarantine_entry()) for c in runs if c.problem is not None)],
               key=lambda x: x[0])
    return [line for _, line in rows], [e for _, e in q]


def quarantine_entry(source: str, row: int, problem: Problem, raw=None, sample_id: str | None = None) -> dict:
    entry = {"source": source, "row": row, "sample_id": sample_id, "kind": problem.kind, "reason": problem.reason,
             "raw": raw}
    if problem.generated is not None:
        entry["generated"] = problem.generated
    return entry


def dumps_row(rec: dict) -> str:
    """One JSONL line, the same bytes for the same row (prepare's chunk keys hash them)."""
    return json.dumps(rec, ensure_ascii=False, sort_keys=True, default=str)
