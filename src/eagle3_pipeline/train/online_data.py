"""The online trainer's dataset: speculators' `ArrowDataset` (rows generated on demand by the vLLM server,
`on_missing: generate`) that fetches the rows of one packed batch concurrently.

speculators fetches a batch's rows one after another (PyTorch calls `dataset[i]` per index), so online every
row waited for its own server round trip, and the server never saw more than one request: 5-30 s per
1,024-token step on the tiny target, measured. PyTorch's map-style fetcher calls `__getitems__(indices)`
when a dataset has it; here it sends the batch's rows at once (up to `max_in_flight`), so the server
batches them like an extraction. Imported in the train child only (it imports speculators); a module of
its own so that DataLoader worker processes (spawned) can unpickle the dataset.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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
