"""The online trainer's data path: speculators' `ArrowDataset` (rows generated on demand by the vLLM server,
`on_missing: generate`) that fetches the rows of one packed batch concurrently, and the file transfer
that reads the server's files (`ServerFileTransfer`).

speculators fetches a batch's rows one after another (PyTorch calls `dataset[i]` per index), so online every
row waited for its own server round trip, and the server never saw more than one request: 5-30 s per
1,024-token step on the tiny target, measured. PyTorch's map-style fetcher calls `__getitems__(indices)`
when a dataset has it; here it sends the batch's rows at once (up to `max_in_flight`), so the server
batches them like an extraction. Imported in the train child only (it imports speculators); a module of
its own so that DataLoader worker processes (spawned) can unpickle the dataset.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from hs_connectors.transfer import FP8Transfer
from safetensors.torch import load_file
from speculators.train.data import ArrowDataset


class ConcurrentArrowDataset(ArrowDataset):
    max_in_flight: int = 16

    def __getitems__(self, indices: list[int]) -> list:
        pool = getattr(self, "_eagle3_pool", None)
        if pool is None:  # one per process, made on first use (never pickled)
            pool = self._eagle3_pool = ThreadPoolExecutor(max_workers=self.max_in_flight)
        if self.on_missing == "generate" and self.client is None:
            self._setup_client()  # once, before the threads share the client
        return list(pool.map(self.__getitem__, indices))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_eagle3_pool", None)
        return state


class ServerFileTransfer(FP8Transfer):
    """hs_connectors' file transfer for the online server's files, waiting for a file as long as a request
    may take (`wait_s`, train.online_request_timeout_s) instead of its fixed 10 s lock wait, which a busy
    machine exceeded (each time the row was generated again), and removing the connector's `.lock` too."""

    def __init__(self, hidden_states_path: Path, wait_s: float):
        super().__init__(hidden_states_path, torch.bfloat16)
        self.wait_s = wait_s

    def get_generated(self, hs_transfer_params: dict) -> dict | None:
        from eagle3_pipeline.train.online import await_hidden_states_file

        path = Path(hs_transfer_params.get("hidden_states_path") or hs_transfer_params.get("handle"))
        await_hidden_states_file(path, self.wait_s)
        return self._dequantize(load_file(path))

    def delete(self, handle: str) -> None:
        Path(handle).unlink(missing_ok=True)
        Path(f"{handle}.lock").unlink(missing_ok=True)
