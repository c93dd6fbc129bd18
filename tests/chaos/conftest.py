"""The chaos suite's fixture: a tag that marks every process a trial starts (tests/helpers/chaos.py
has the rest: trial counts, the gate after a kill, the delayed killer)."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers.chaos import TAG_ENV


@pytest.fixture
def tag(monkeypatch) -> str:
    """A fresh tag in this process's environment (children inherit it): `processes_with_env` finds
    every process a trial started, wherever it was reparented."""
    value = f"chaos-{uuid.uuid4().hex}"
    monkeypatch.setenv(TAG_ENV, value)
    return value
