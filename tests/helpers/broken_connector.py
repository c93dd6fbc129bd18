"""A deliberately broken hidden-states connector, for tests of the verify gate only.

`OffsetDriftConnector` behaves like ours for the first request that finishes in an engine step, and
reads every later request of the same step one token late (token t gets the hidden states of token
t+1, the last token repeats itself): the kind of offset bug that appears only when several requests
share a batch. Every record it writes is structurally perfect (token ids, [T, L, H], bf16, finite,
plausible norms); only comparing with a batch-of-one extraction (verify/invariance.py) or with a
reference model finds it. Loaded by vLLM inside the extract child (and its engine processes) through
`ExtractConfig.connector_module="tests.helpers.broken_connector"`, with the repository root on the
child's PYTHONPATH (tests/integration/test_verify.py sets it; the child's cwd is not relied on).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import extract_from_kv_cache

from eagle3_pipeline.extract.connector import Eagle3HiddenStatesConnector, _CompletedEvent


class OffsetDriftConnector(Eagle3HiddenStatesConnector):
    def get_finished(self, finished_req_ids):
        self._position_in_step = 0  # get_finished hands over the requests that finished in one step
        return super().get_finished(finished_req_ids)

    def _submit_async_write(self, pending) -> None:
        k = getattr(self, "_position_in_step", 0)
        self._position_in_step = k + 1
        if k == 0 or not self._is_tp_rank_zero:
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        slots = torch.cat([slots[1:num_tokens], slots[num_tokens - 1:num_tokens]])  # THE BUG: one token late
        _write(self, pending, extract_from_kv_cache(self._kv_cache, slots, num_tokens))  # [T, L, H]


def _write(connector, pending, hidden_states) -> None:
    """What our connector does with a request's states on the CPU, for states these test connectors chose."""
    os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
    tmp = f"{pending.filename}.tmp-{os.getpid()}"
    lock_fd = connector._lock_fds.pop(pending.req_id, None)
    try:
        save_file({"hidden_states": hidden_states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
        os.replace(tmp, pending.filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    connector._req_copy_events[pending.req_id] = _CompletedEvent()


# ---------------------------------------------------------------- rare, structurally perfect corruption

CORRUPT_EVERY_ENV = "EAGLE3_TEST_CORRUPT_EVERY"  # one request in N is corrupted (default 50: 2%)
MODES = ("permuted aux layers", "zeroed tail after the first KV block", "another request's states",
         # few tokens: every layer of them taken from the request written before, at the same positions
         "a single token (the last)", "a stale last KV block", "another request's states after the shared prefix",
         # aux layers only (the final layer right, so the fingerprint cannot see them)
         "one aux layer of a single token", "another request's aux layers after the shared prefix")
FEW_TOKEN_MODES = MODES[3:6]
AUX_ONLY_MODES = MODES[6:]


def corruption_of(token_ids, every: int | None = None) -> str | None:
    """Which corruption `RareCorruptionConnector` applies to a request with these token ids (None: it
    is written clean): a hash of the ids, so tests can predict the bad rows from the tokenized data."""
    import hashlib

    every = every or int(os.environ.get(CORRUPT_EVERY_ENV, "50"))
    blob = torch.as_tensor(list(map(int, token_ids)), dtype=torch.int64).numpy().tobytes()
    h = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little")
    return MODES[(h // every) % len(MODES)] if h % every == 0 else None


class RareCorruptionConnector(Eagle3HiddenStatesConnector):
    """Writes about one request in `EAGLE3_TEST_CORRUPT_EVERY` wrong, in ways every structural check
    accepts (token ids, [T, L, H], dtype, finite values and plausible norms are all right):
    the first two aux layers swapped, every token after the first KV block zeroed (a block that was
    never written), or the hidden states of the previous request this connector wrote (truncated or
    tiled to this request's length) under this request's name."""

    _previous = None
    _previous_ids = None

    def _mode_of(self, pending) -> str | None:
        return corruption_of(pending.token_ids)

    def _states(self, pending):
        """[T, L, H]: the request's hidden states as the connector is about to write them, from the KV cache."""
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        return extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()

    def _submit_async_write(self, pending) -> None:
        mode = self._mode_of(pending) if self._is_tp_rank_zero else None
        if mode is None:
            if self._is_tp_rank_zero:  # kept from the KV cache now: the file is written asynchronously, and
                # reading it back here raced its writer (a half-written file failed the engine: HTTP 500 online)
                self._previous, self._previous_ids = self._states(pending), pending.token_ids.clone()
            super()._submit_async_write(pending)
            return
        num_tokens = pending.token_ids.shape[0]
        hs = self._states(pending)  # [T, L, H]
        if mode == MODES[0]:
            hs[:, [0, 1]] = hs[:, [1, 0]]
        elif mode == MODES[1]:  # a row within one block loses its second half (else it would be clean)
            hs[self._block_size if num_tokens > self._block_size else num_tokens // 2:] = 0
        elif mode in FEW_TOKEN_MODES or mode in AUX_ONLY_MODES:
            hs = _few_tokens(hs, mode, self._previous, self._block_size, pending.token_ids, self._previous_ids)
        elif self._previous is not None:
            prev = self._previous
            reps = -(-num_tokens // prev.shape[0])
            hs = prev.repeat(reps, 1, 1)[:num_tokens].to(hs.dtype)
        else:  # nothing written yet to borrow from: roll this request's own states by half its length
            hs = torch.roll(hs, shifts=max(1, num_tokens // 2), dims=0)
        _write(self, pending, hs)


CORRUPT_AFTER_ENV = "EAGLE3_TEST_CORRUPT_AFTER"  # requests written clean before any is corrupted
CORRUPT_MODE_ENV = "EAGLE3_TEST_CORRUPT_MODE"    # the one mode of MODES applied
# a JSON file {"mode": one of MODES or null, "clean": [ids_key of rows always written clean]}, read at every
# request instead of the two above: one running server, its corruption changed between runs (a test's cases)
CORRUPT_CONTROL_ENV = "EAGLE3_TEST_CORRUPT_CONTROL"


def ids_key(token_ids) -> str:
    """A row's key in a control file's "clean" list: the sha256 of its token ids (int64 bytes)."""
    import hashlib

    return hashlib.sha256(torch.as_tensor(list(map(int, token_ids)), dtype=torch.int64).numpy().tobytes()).hexdigest()


class LateCorruptionConnector(RareCorruptionConnector):
    """The rows `corruption_of` picks, corrupted in the one mode `EAGLE3_TEST_CORRUPT_MODE` names, but only
    after the first `EAGLE3_TEST_CORRUPT_AFTER` requests: an online-training server whose verified sample
    is clean and whose later rows are not (the same rows again when asked again: keyed by token ids).
    With `EAGLE3_TEST_CORRUPT_CONTROL`: the mode that file names, every row but its "clean" ones (the
    sample's, by token ids: no count, so a request left over from an earlier run cannot shift it)."""

    _seen = 0

    def _mode_of(self, pending) -> str | None:
        control = os.environ.get(CORRUPT_CONTROL_ENV)
        if control:
            with open(control) as f:
                c = json.load(f)
            if c["mode"] is None or corruption_of(pending.token_ids) is None:
                return None
            return None if ids_key(pending.token_ids) in set(c["clean"]) else c["mode"]
        type(self)._seen += 1
        if type(self)._seen <= int(os.environ.get(CORRUPT_AFTER_ENV, "0")) or corruption_of(pending.token_ids) is None:
            return None
        return os.environ[CORRUPT_MODE_ENV]


def _few_tokens(hs, mode: str, prev, block: int, ids, prev_ids):
    """`hs` [T, L, H] with a few tokens' states (every layer) replaced by the previous clean request's at
    the same positions (where it has none, this request's own states of the next token): the last
    token; the last KV block; the tokens after the prefix the two requests share. The aux-only modes
    replace the first aux layer of the first token after the shared prefix, or every aux layer (not the
    final one) of the four tokens after it. The tokens replaced are ones whose states differ from the
    previous request's, so each record is really wrong."""
    T = hs.shape[0]
    src = prev if prev is not None else hs
    shared = 0
    if prev_ids is not None:
        n = min(T, len(prev_ids))
        diff = (ids[:n].to(torch.int64) != prev_ids[:n].to(torch.int64)).nonzero()
        shared = int(diff[0]) if len(diff) else n
    if mode == FEW_TOKEN_MODES[0]:
        pos = [T - 1]
    elif mode == FEW_TOKEN_MODES[1]:
        pos = list(range(max(shared, ((T - 1) // block) * block), T))
    elif mode == AUX_ONLY_MODES[0]:
        pos = [min(shared, T - 1)]
    else:
        pos = list(range(shared, min(T, shared + 4)))
    pos = [p for p in pos if p >= shared] or [T - 1]
    layers = slice(0, 1) if mode == AUX_ONLY_MODES[0] else slice(0, hs.shape[1] - 1) if mode in AUX_ONLY_MODES \
        else slice(None)
    out = hs.clone()
    for p in pos:
        other = src[p] if src is not hs and p < src.shape[0] else hs[(p + 1) % T]
        out[p, layers] = other[layers].to(hs.dtype)
    return out
