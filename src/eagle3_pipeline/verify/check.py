"""A verify check as a small object: it says which items of a batch it judges (`admits`), why it cannot judge
them (`unable`) and its verdict on them (`verdict`); the base (`Check.run`) does the rest: it counts the items
judged and flagged, times the check and fills the check's result model (records/verification.py), which is its
entry in verify.json and in the report. How to add one: docs/verification.md, "Adding a check".
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from eagle3_pipeline.records.verification import CheckResult

Item = TypeVar("Item")


@dataclass
class Verdict:
    """A check's verdict on the items it judged: the rows it flags with their problems (an empty list: flagged,
    its problem said by the scan that measured it), and the check's own numbers (its result model's fields)."""
    flags: dict[int, list[str]] = field(default_factory=dict)
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    result: CheckResult
    flags: dict[int, list[str]]


class Check(ABC, Generic[Item]):
    """One check: `name` (its key in VerifyResult.checks), `result` (its result model), one `verdict`."""
    name: ClassVar[str]
    result: ClassVar[type[CheckResult]] = CheckResult

    def admits(self, item: Item) -> bool:
        """Whether the check judges this item (default: every one)."""
        return True

    def unable(self, items: list[Item]) -> str | None:
        """Why the check cannot judge these items (None: it can)."""
        return None

    @abstractmethod
    def verdict(self, items: list[Item]) -> Verdict:
        """The check's flags and numbers on the items it admits (each concrete check says how)."""

    def run(self, batch: list[Item]) -> Outcome:
        t0 = time.perf_counter()
        items = [x for x in batch if self.admits(x)]
        why = self.unable(items)
        if why is not None:
            return Outcome(self.result(skipped=why, seconds=round(time.perf_counter() - t0, 4)), {})
        v = self.verdict(items)
        res = self.result(ran=True, records=len(items), flagged=len(v.flags), seconds=round(time.perf_counter() - t0, 4),
                          **v.numbers)
        return Outcome(res, v.flags)


class RecordCheck(Check[Item]):
    """A check whose verdict is on each item alone: `problems_of` one item (a non-empty list, or True: flagged)."""

    @abstractmethod
    def problems_of(self, item: Item) -> list[str] | bool:
        """One item's problems (each concrete record check says which)."""

    def row_of(self, item: Item) -> int:
        return item.row

    def verdict(self, items: list[Item]) -> Verdict:
        flags = {}
        for it in items:
            found = self.problems_of(it)
            if found:
                flags.setdefault(self.row_of(it), []).extend(found if isinstance(found, list) else [])
        return Verdict(flags, self.numbers(items))

    def numbers(self, items: list[Item]) -> dict[str, Any]:
        """The check's own numbers over the items it judged (default: none)."""
        return {}


def merge(problems: dict[int, list[str]], flags: dict[int, list[str]]) -> None:
    """A check's flags into the problems by row (a flag with no problem of its own adds none: the scan that
    measured it said it)."""
    for row, found in flags.items():
        if not found:
            continue
        have = problems.setdefault(row, [])
        have += [p for p in found if p not in have]
