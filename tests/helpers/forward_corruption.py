"""A forward pass that computes some rows wrong, upstream of every engine-side record, for tests of the verify
gate only.

Importing this module (vLLM imports it in its worker process as the KV connector's module:
`extract.connector_module="tests.helpers.forward_corruption"`, `extract.connector_name="ForwardCorruptionConnector"`)
wraps V1's `GPUModelRunner._model_forward`: for the requests `corrupted` picks (one in EAGLE3_TEST_CORRUPT_EVERY,
by a hash of the prompt's token ids, so a test predicts the rows), the positions of their tokens in the step are
replaced before the model runs (`EAGLE3_TEST_FORWARD_MODE`: "reversed", each request's positions in reverse
order; "restart", positions counted again from 0 halfway through; "tokens", the request's input ids rolled by
one; "context", the first quarter of the request's input ids in reverse order, so every later token attends to a
wrong context at the right positions (what a prefix-cache hit on another prompt's KV gives); several modes
separated by commas: each corrupted request takes one, by the same hash). The model then computes states for the wrong positions (or inputs), and the captured states, the state
sketch, the logits and the fingerprint all come from that one forward, so they agree with each other: the
transport checks pass; only a check of what the target computes (the reference, a prediction signal) sees it.
The connector itself is ours, unchanged.

`StateAndForwardCorruptionConnector` carries both kinds of corruption in one extraction: the forward corrupted as
above for the requests `corrupted` picks (one in EAGLE3_TEST_FORWARD_EVERY when set), and the records of the
requests `broken_connector.corruption_of` picks among the others (one in EAGLE3_TEST_CORRUPT_EVERY) written wrong
as `RareCorruptionConnector` writes them: two disjoint row sets, found by different checks
(tests/integration/test_real_pipeline.py).
"""

from __future__ import annotations

import hashlib
import os

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from eagle3_pipeline.extract.connector import Eagle3HiddenStatesConnector
from tests.helpers.broken_connector import RareCorruptionConnector

EVERY_ENV = "EAGLE3_TEST_CORRUPT_EVERY"
FORWARD_EVERY_ENV = "EAGLE3_TEST_FORWARD_EVERY"  # the forward's own N, when the records' corruption takes EVERY_ENV
MODE_ENV = "EAGLE3_TEST_FORWARD_MODE"
MODES = ("reversed", "restart", "tokens", "context")


def _hash(token_ids) -> int:
    blob = torch.as_tensor(list(map(int, token_ids)), dtype=torch.int64).numpy().tobytes()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little")


def corrupted(token_ids, every: int | None = None) -> bool:
    """Whether the forward of a request with these prompt token ids is corrupted."""
    every = every or int(os.environ.get(FORWARD_EVERY_ENV) or os.environ.get(EVERY_ENV, "20"))
    return _hash(token_ids) % every == 0


def mode_of(token_ids, modes: str | None = None) -> str:
    """The corruption mode of a corrupted request (one of MODE_ENV's comma-separated modes, by hash)."""
    names = [m.strip() for m in (modes or os.environ.get(MODE_ENV, "reversed")).split(",") if m.strip()]
    return names[(_hash(token_ids) >> 32) % len(names)]


_own = GPUModelRunner._model_forward


def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
    starts = self.query_start_loc.np
    for i, req_id in enumerate(self.input_batch.req_ids):
        req = self.requests.get(req_id)
        if req is None or req.prompt_token_ids is None or not corrupted(req.prompt_token_ids):
            continue
        a, b = int(starts[i]), int(starts[i + 1])
        if b - a < 2:
            continue
        mode = mode_of(req.prompt_token_ids)
        if mode == "reversed" and positions is not None:
            positions[a:b] = positions[a:b].flip(0).clone()
        elif mode == "restart" and positions is not None:
            half = (b - a) // 2
            positions[a + half:b] = positions[a:b - half].clone()
        elif mode == "tokens" and input_ids is not None:
            input_ids[a:b] = torch.roll(input_ids[a:b], 1).clone()
        elif mode == "context" and input_ids is not None and int(req.num_computed_tokens) == 0:
            q = max(2, (b - a) // 4)
            input_ids[a:a + q] = input_ids[a:a + q].flip(0).clone()
    return _own(self, input_ids, positions, *args, **kwargs)


GPUModelRunner._model_forward = _model_forward


class ForwardCorruptionConnector(Eagle3HiddenStatesConnector):
    """Our connector, unchanged: the corruption is in the forward this module wrapped on import."""


class StateAndForwardCorruptionConnector(RareCorruptionConnector):
    """The forward corrupted for the requests `corrupted` picks (EAGLE3_TEST_FORWARD_EVERY), their records written
    as computed; the records of the requests `corruption_of` picks among the others (EAGLE3_TEST_CORRUPT_EVERY)
    corrupted as `RareCorruptionConnector` does, borrowing states only from requests whose forward was right."""

    def _submit_async_write(self, pending) -> None:
        if corrupted(pending.token_ids):  # not a record corruption, nor another's source of states
            Eagle3HiddenStatesConnector._submit_async_write(self, pending)
            return
        super()._submit_async_write(pending)
