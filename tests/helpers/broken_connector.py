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
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, num_tokens)  # [T, L, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tmp = f"{pending.filename}.tmp-{os.getpid()}"
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden_states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _CompletedEvent()
