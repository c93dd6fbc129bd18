"""Our vLLM KV connector for the native `extract_hidden_states` speculative method.

More: docs/internals.md, "extract/connector.py".
"""

from __future__ import annotations

import os

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from eagle3_pipeline.records.contracts import record_metadata, save_safetensors, to_record

logger = init_logger(f"vllm.{__name__}")  # under `vllm`, so vLLM's handler prints it in every worker
CONNECTOR_LOG = "eagle3 hidden-states connector"  # prefix of the one line each TP rank logs at start


class _CompletedEvent:
    """Stands in for the parent's CUDA copy event: the write has already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Eagle3HiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` that also works when the KV cache is on the CPU."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)  # decides `_is_tp_rank_zero` after distributed init
        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        role = "writes hidden states" if self._is_tp_rank_zero else "does not write (rank 0 writes)"
        logger.info("%s: TP rank %d of %d %s", CONNECTOR_LOG, rank, size, role)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return  # same rule as the parent: rank 0 writes, every rank runs this code
        assert self._kv_cache is not None, "register_kv_caches was not called"
        if self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)  # async DtoH + thread-pool write

        # Slots of this request in the hidden-states cache: every offset of every block.
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # Advanced indexing copies, so the blocks may be reused as soon as we return.
        # only the request's own slots (vLLM's helper gathers whole blocks, then cuts them to T)
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping[:num_tokens], num_tokens)  # [T, L, H]
        self._write(pending, hidden_states)

    def _write(self, pending: PendingSave, hidden_states: torch.Tensor) -> None:
        """Write `hidden_states` [T, L, H] of `pending` (CPU): the record when `eagle3_record` is
        configured, else vLLM's layout; atomic, so a reader never sees a partial file under the name."""
        spec = self._kv_transfer_config.get_from_extra_config("eagle3_record", None)
        if spec:
            tensors = to_record(hidden_states, pending.token_ids, spec["storage_dtype"])
            meta = record_metadata(spec["layer_ids"], spec["storage_dtype"])
        else:
            tensors, meta = {"hidden_states": hidden_states.contiguous(), "token_ids": pending.token_ids.clone()}, None
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tmp = f"{pending.filename}.tmp-{os.getpid()}"
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # LOCK_EX taken in wait_for_save (if locks are on)
        try:
            save_safetensors(tmp, tensors, meta)
            os.replace(tmp, pending.filename)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
            if lock_fd is not None:
                os.close(lock_fd)  # releases readers blocked on the .lock file
        self._req_copy_events[pending.req_id] = _CompletedEvent()
